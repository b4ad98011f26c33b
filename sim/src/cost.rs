//! The step-time model: how long one engine step takes on a GPU profile, from the work the step
//! does. A roofline: the step is bound by compute (2 x params FLOPs per token processed plus
//! attention FLOPs, at [`PREFILL_MFU`] of dense peak) or by memory (all weights plus the KV
//! cache the step reads, at [`DECODE_MBU`] of HBM bandwidth), whichever is slower. Prefill-heavy
//! steps therefore scale with uncached prompt tokens, decode steps with the weights plus the KV
//! touched, so they grow with batch size and context.

use crate::profiles::{GpuProfile, ModelProfile, DECODE_MBU, PREFILL_MFU};

/// The work of one step, summed over the sequences scheduled in it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepWork {
    /// Tokens computed in the step (prefill chunk tokens plus one per decoding sequence).
    pub tokens: u64,
    /// Sum over every computed token of the number of earlier tokens it attends to
    /// (its position + 1): the attention score/value work.
    pub attended_positions: f64,
    /// Sum over scheduled sequences of their context length after the step: KV-cache tokens read.
    pub kv_tokens_read: u64,
}

impl StepWork {
    /// Adds a sequence that computes tokens `[start, end)` of its context in this step.
    pub fn add_chunk(&mut self, start: u64, end: u64) {
        if end <= start {
            return;
        }
        self.tokens += end - start;
        // sum_{p=start}^{end-1} (p + 1) = (end(end+1) - start(start+1)) / 2
        let (s, e) = (start as f64, end as f64);
        self.attended_positions += (e * (e + 1.0) - s * (s + 1.0)) / 2.0;
        self.kv_tokens_read += end;
    }

    /// True if the step computes nothing.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }
}

/// Seconds one step takes at `speed` x the profile's speed.
///
/// FLOPs: 2 x params per token for the weight matmuls, plus 4 x layers x attention width per
/// attended position (QK^T and AV, 2 FLOPs per multiply-add each). Bytes: the weights once per
/// step plus the KV cache of every scheduled sequence (Kipp, "Transformer Inference
/// Arithmetic", 2022, gives the same two terms).
pub fn step_seconds(gpu: &GpuProfile, model: &ModelProfile, work: &StepWork, speed: f64) -> f64 {
    if work.is_empty() {
        return 0.0;
    }
    let flops = 2.0 * model.params * work.tokens as f64
        + 4.0 * f64::from(model.layers) * f64::from(model.attn_width) * work.attended_positions;
    let compute = flops / (gpu.bf16_flops * PREFILL_MFU);
    let bytes = model.weight_bytes() + model.kv_bytes_per_token() * work.kv_tokens_read as f64;
    let memory = bytes / (gpu.memory_bandwidth * DECODE_MBU);
    compute.max(memory) / speed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profiles::{gpu, model};

    fn llama() -> &'static ModelProfile {
        model("meta-llama/Llama-3.1-8B-Instruct", None).unwrap()
    }

    fn decode_batch(n: u64, ctx: u64) -> StepWork {
        let mut w = StepWork::default();
        for _ in 0..n {
            w.add_chunk(ctx - 1, ctx);
        }
        w
    }

    #[test]
    fn decode_step_time_grows_with_batch() {
        let h100 = gpu("h100").unwrap();
        let t1 = step_seconds(h100, llama(), &decode_batch(1, 1000), 1.0);
        let t32 = step_seconds(h100, llama(), &decode_batch(32, 1000), 1.0);
        let t256 = step_seconds(h100, llama(), &decode_batch(256, 1000), 1.0);
        assert!(t1 < t32 && t32 < t256, "{t1} {t32} {t256}");
        // batch 1 is weight-bound: 16.2 GB / (3.35 TB/s x 0.7) = ~6.9 ms
        assert!((t1 - 0.0069).abs() < 0.0005, "{t1}");
    }

    #[test]
    fn prefill_time_is_proportional_to_tokens() {
        let h100 = gpu("h100").unwrap();
        let mut a = StepWork::default();
        a.add_chunk(0, 2000);
        let mut b = StepWork::default();
        b.add_chunk(0, 4000);
        let ta = step_seconds(h100, llama(), &a, 1.0);
        let tb = step_seconds(h100, llama(), &b, 1.0);
        // compute-bound: doubling tokens roughly doubles time (attention adds a little more)
        assert!(tb > 1.9 * ta && tb < 2.3 * ta, "{ta} {tb}");
    }

    #[test]
    fn l40s_is_about_three_times_slower_than_h100() {
        let (h, l) = (gpu("h100").unwrap(), gpu("l40s").unwrap());
        let mut prefill = StepWork::default();
        prefill.add_chunk(0, 2048);
        let decode = decode_batch(16, 1500);
        let rp = step_seconds(l, llama(), &prefill, 1.0) / step_seconds(h, llama(), &prefill, 1.0);
        let rd = step_seconds(l, llama(), &decode, 1.0) / step_seconds(h, llama(), &decode, 1.0);
        // datasheet ratios: 989/362 = 2.7 (compute), 3350/864 = 3.9 (bandwidth)
        assert!((rp - 2.73).abs() < 0.05, "{rp}");
        assert!((rd - 3.88).abs() < 0.05, "{rd}");
    }

    #[test]
    fn speed_multiplier_divides_time() {
        let h = gpu("h100").unwrap();
        let w = decode_batch(8, 500);
        let t = step_seconds(h, llama(), &w, 1.0);
        assert!((step_seconds(h, llama(), &w, 2.0) - t / 2.0).abs() < 1e-12);
    }
}
