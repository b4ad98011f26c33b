//! GPU and model profiles: the public figures every simulated duration and capacity is derived
//! from. Nothing here is tuned toward any router; each number names its source, and the two
//! efficiency factors are the same for every GPU, so speed ratios between profiles come only
//! from datasheet figures.

use crate::error::ConfigError;

/// Bytes in a GiB.
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Fraction of dense BF16 tensor peak that a prefill (compute-bound) forward pass reaches.
/// Source: published model-FLOPs-utilisation figures for LLM prefill and training with fused
/// kernels sit around 40-60% of dense peak (MFU as defined in Chowdhery et al., "PaLM", 2022,
/// section 4.1; the open-source-ai.tech glossary "model FLOPs utilization" describes prefill MFU
/// as the derating of dense peak). 0.5 is the middle of that band.
pub const PREFILL_MFU: f64 = 0.5;

/// Fraction of datasheet HBM bandwidth that a decode step (memory-bound) achieves.
/// Source: "model bandwidth utilisation" (MBU) as defined in the Databricks/MosaicML post
/// "LLM Inference Performance Engineering: Best Practices" (2023); well-optimised CUDA serving
/// stacks (vLLM, TensorRT-LLM) reach roughly 60-85% MBU (open-source-ai.tech glossary "model
/// bandwidth utilization"). 0.7 sits at the conservative end of that band.
pub const DECODE_MBU: f64 = 0.7;

/// vLLM's default `--gpu-memory-utilization` (vLLM engine arguments documentation).
pub const GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// Memory vLLM keeps outside weights and KV cache: the profile run's peak activations for an
/// 8192-token batch (an 8B model's MLP intermediate 8192 x 14336 x 2 x 2 bytes is ~0.45 GiB, the
/// sampler's 256 x 128k-vocabulary fp32 logits ~0.12 GiB, plus attention workspace), CUDA graphs
/// and non-torch allocations. An estimate, not a published constant: about 2 GiB.
pub const NON_KV_RESERVE_BYTES: f64 = 2.0 * GIB;

/// One GPU class, from its datasheet.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuProfile {
    /// Profile key used in fleet files (`"h100"`).
    pub name: &'static str,
    /// Human-readable model name.
    pub description: &'static str,
    /// Device memory in bytes: `nvidia-smi`'s `memory.total` (MiB x 2^20).
    pub memory_bytes: f64,
    /// Peak memory bandwidth in bytes/s.
    pub memory_bandwidth: f64,
    /// Dense (no sparsity) BF16 tensor-core peak in FLOP/s.
    pub bf16_flops: f64,
}

/// Bytes in a MiB.
const MIB: f64 = 1024.0 * 1024.0;

/// The built-in GPU profiles.
///
/// `memory_bytes` is the device's total memory as `nvidia-smi` reports it (`memory.total`, in
/// MiB), the figure vLLM's `gpu_memory_utilization` is a fraction of. The datasheets' "80 GB"
/// of HBM is 80 GiB (85.9e9 bytes), not 80e9: before 2026-12-07 these profiles said 80e9, 7%
/// short, which left Qwen3-32B on an H100 1,013 KV blocks instead of 2,198 (see
/// `num_gpu_blocks`). What CUDA itself reports as the total (`cudaMemGetInfo`, which vLLM reads
/// and logs as `total_gpu_memory`) is a further ~0.5 GiB below `nvidia-smi`'s (vLLM logs
/// 79.1-79.3 GiB on 80 GB cards): not modelled, worth ~115 of Qwen3-32B's blocks on an H100.
///
/// - H100 SXM5 80GB: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS dense BF16 (the datasheet's 1,979 is
///   with 2:4 sparsity). NVIDIA H100 Tensor Core GPU datasheet. `nvidia-smi` on an "NVIDIA H100
///   80GB HBM3": 81,559 MiB total (of the 81,920 MiB = 80 GiB of HBM3).
/// - A100 SXM4 80GB: 80 GB HBM2e, 2,039 GB/s, 312 TFLOPS dense BF16. NVIDIA A100 datasheet.
///   `nvidia-smi` on an "NVIDIA A100-SXM4-80GB": 81,920 MiB total (80 GiB).
/// - L40S: 48 GB GDDR6 with ECC, 864 GB/s, 362.05 TFLOPS dense BF16 (733 with sparsity). NVIDIA
///   L40S datasheet. `nvidia-smi` on an "NVIDIA L40S": 46,068 MiB total (48.3e9 bytes; 48 GiB
///   less the ECC reservation).
/// - A10 / A10G: 24 GB GDDR6, 600 GB/s, 125 TFLOPS dense BF16 (250 with sparsity). NVIDIA A10
///   datasheet; AWS's A10G (G5 instances) has the same 24 GB / 600 GB/s memory system, and AWS
///   does not publish a separate tensor figure, so the A10's is used. `nvidia-smi` on an "NVIDIA
///   A10G" and on an "NVIDIA A10": 23,028 MiB total (24.1e9 bytes).
pub const GPUS: &[GpuProfile] = &[
    GpuProfile {
        name: "h100",
        description: "NVIDIA H100 SXM5 80GB",
        memory_bytes: 81_559.0 * MIB,
        memory_bandwidth: 3.35e12,
        bf16_flops: 989e12,
    },
    GpuProfile {
        name: "a100",
        description: "NVIDIA A100 SXM4 80GB",
        memory_bytes: 81_920.0 * MIB,
        memory_bandwidth: 2.039e12,
        bf16_flops: 312e12,
    },
    GpuProfile {
        name: "l40s",
        description: "NVIDIA L40S 48GB",
        memory_bytes: 46_068.0 * MIB,
        memory_bandwidth: 864e9,
        bf16_flops: 362.05e12,
    },
    GpuProfile {
        name: "a10g",
        description: "NVIDIA A10G / A10 24GB",
        memory_bytes: 23_028.0 * MIB,
        memory_bandwidth: 600e9,
        bf16_flops: 125e12,
    },
];

/// Looks a GPU profile up by key (case-insensitive).
pub fn gpu(name: &str) -> Result<&'static GpuProfile, ConfigError> {
    let key = name.to_ascii_lowercase();
    let key = if key == "a10" {
        "a10g".to_string()
    } else {
        key
    };
    GPUS.iter()
        .find(|g| g.name == key)
        .ok_or_else(|| ConfigError::UnknownGpu {
            gpu: name.to_string(),
            known: GPUS.iter().map(|g| g.name).collect::<Vec<_>>().join(", "),
        })
}

/// The architecture figures of one model, from its Hugging Face `config.json` and model card.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelProfile {
    /// Key used by the fleet file's `arch` field (`"llama-3.1-8b"`).
    pub key: &'static str,
    /// Lower-case substrings of a model name that select this profile.
    pub matches: &'static [&'static str],
    /// Parameter count.
    pub params: f64,
    /// `num_hidden_layers`.
    pub layers: u32,
    /// `num_attention_heads x head_dim` (the attention width).
    pub attn_width: u32,
    /// `num_key_value_heads`.
    pub kv_heads: u32,
    /// `head_dim`.
    pub head_dim: u32,
    /// `max_position_embeddings`: vLLM's default `max_model_len`.
    pub max_position: u32,
}

/// Bytes per weight and per KV element: BF16, vLLM's `dtype=auto` and `kv_cache_dtype=auto` for
/// these checkpoints.
pub const BYTES_PER_ELEMENT: f64 = 2.0;

/// The built-in model profiles.
///
/// - Llama-3.1-8B(-Instruct): 8.03B parameters (model card), 32 layers, hidden 4096 (32 heads x
///   128), 8 KV heads, head_dim 128, max_position_embeddings 131072 (`config.json`).
/// - Qwen2.5-7B(-Instruct): 7.61B parameters (model card), 28 layers, 28 heads x 128 = 3584,
///   4 KV heads, max_position_embeddings 32768 (`config.json`).
/// - Qwen3-8B: 8.2B parameters, 36 layers, 32 heads x 128, 8 KV heads, max 40960 (`config.json`).
/// - Qwen3-32B: 32.8B parameters, 64 layers, 64 heads x 128, 8 KV heads, max 40960
///   (`config.json`); 65.6e9 bytes of weights leave an 80 GB GPU ~35k tokens of KV cache
///   (2,198 blocks of 16 on an H100, 2,279 on an A100).
/// - Whisper large-v3: below.
pub const MODELS: &[ModelProfile] = &[
    ModelProfile {
        key: "llama-3.1-8b",
        matches: &[
            "llama-3.1-8b",
            "llama-3-8b",
            "meta-llama-3-8b",
            "llama3-8b",
            "llama-3.2-8b",
        ],
        params: 8.03e9,
        layers: 32,
        attn_width: 4096,
        kv_heads: 8,
        head_dim: 128,
        max_position: 131_072,
    },
    ModelProfile {
        key: "qwen2.5-7b",
        matches: &["qwen2.5-7b", "qwen2-7b"],
        params: 7.61e9,
        layers: 28,
        attn_width: 3584,
        kv_heads: 4,
        head_dim: 128,
        max_position: 32_768,
    },
    ModelProfile {
        key: "qwen3-8b",
        matches: &["qwen3-8b"],
        params: 8.2e9,
        layers: 36,
        attn_width: 4096,
        kv_heads: 8,
        head_dim: 128,
        max_position: 40_960,
    },
    ModelProfile {
        key: "qwen3-32b",
        matches: &["qwen3-32b"],
        params: 32.8e9,
        layers: 64,
        attn_width: 8192,
        kv_heads: 8,
        head_dim: 128,
        max_position: 40_960,
    },
    // Whisper large-v3 (`openai/whisper-large-v3`): 1.55B parameters (model card), 32 decoder
    // layers of 20 heads x 64 (d_model 1280, no grouped KV heads), 448 text positions
    // (`config.json`). The simulation runs the encoder's 1,500 frames per 30 s of audio as a
    // prompt (`crate::http`'s transcriptions), so its context is taken as one window and the
    // text: 1,500 + 448.
    ModelProfile {
        key: "whisper-large-v3",
        matches: &["whisper-large-v3", "whisper-large"],
        params: 1.55e9,
        layers: 32,
        attn_width: 1280,
        kv_heads: 20,
        head_dim: 64,
        max_position: 1_948,
    },
];

impl ModelProfile {
    /// Weight bytes read by every forward pass.
    pub fn weight_bytes(&self) -> f64 {
        self.params * BYTES_PER_ELEMENT
    }

    /// KV-cache bytes per token: K and V, for every layer and KV head.
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * f64::from(self.layers)
            * f64::from(self.kv_heads)
            * f64::from(self.head_dim)
            * BYTES_PER_ELEMENT
    }
}

/// Picks the model profile for a served model name: the explicit `arch` key if given, else the
/// first profile whose pattern occurs in the lower-cased model name.
pub fn model(model_name: &str, arch: Option<&str>) -> Result<&'static ModelProfile, ConfigError> {
    let known = || MODELS.iter().map(|m| m.key).collect::<Vec<_>>().join(", ");
    if let Some(arch) = arch {
        let key = arch.to_ascii_lowercase();
        return MODELS
            .iter()
            .find(|m| m.key == key)
            .ok_or_else(|| ConfigError::UnknownArch {
                arch: arch.to_string(),
                known: known(),
            });
    }
    let lower = model_name.to_ascii_lowercase();
    MODELS
        .iter()
        .find(|m| m.matches.iter().any(|p| lower.contains(p)))
        .ok_or_else(|| ConfigError::UnknownModel {
            model: model_name.to_string(),
            known: known(),
        })
}

/// KV-cache capacity in blocks of `block_size` tokens, the way vLLM sizes it: device memory x
/// `gpu_memory_utilization`, minus weights and the non-KV reserve, over the bytes of one block.
/// vLLM's profile run (`determine_available_memory`) takes `total_gpu_memory x
/// gpu_memory_utilization` and subtracts the weights, the activation peak of a dummy
/// `max_num_batched_tokens` batch and the non-torch allocations it measured; here the last two
/// are `NON_KV_RESERVE_BYTES`, a fixed estimate, and a fleet file's `num_gpu_blocks` overrides
/// the result as `num_gpu_blocks_override` does.
pub fn num_gpu_blocks(
    gpu: &GpuProfile,
    model: &ModelProfile,
    gpu_memory_utilization: f64,
    block_size: u32,
) -> u32 {
    let available =
        gpu.memory_bytes * gpu_memory_utilization - model.weight_bytes() - NON_KV_RESERVE_BYTES;
    let per_block = model.kv_bytes_per_token() * f64::from(block_size);
    if available <= 0.0 || per_block <= 0.0 {
        return 0;
    }
    // floor: a partial block cannot hold a block's worth of tokens
    let blocks = (available / per_block).floor();
    if blocks >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        blocks as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_8b_kv_bytes_per_token_is_128_kib() {
        let m = model("meta-llama/Llama-3.1-8B-Instruct", None).unwrap();
        assert_eq!(m.kv_bytes_per_token(), 131_072.0);
    }

    #[test]
    fn arch_override_and_unknown_model() {
        assert_eq!(
            model("my-finetune", Some("qwen2.5-7b")).unwrap().key,
            "qwen2.5-7b"
        );
        let err = model("mystery-model", None).unwrap_err().to_string();
        assert!(
            err.contains("mystery-model") && err.contains("llama-3.1-8b"),
            "{err}"
        );
        assert!(gpu("tpu").is_err());
        assert_eq!(gpu("A10").unwrap().name, "a10g");
    }

    #[test]
    fn memory_is_what_nvidia_smi_reports() {
        // 80 GB of HBM is 80 GiB: 81,920 MiB on an A100, of which an H100 shows 81,559 MiB
        assert_eq!(gpu("a100").unwrap().memory_bytes, 85_899_345_920.0);
        assert_eq!(gpu("h100").unwrap().memory_bytes, 85_520_809_984.0);
        assert_eq!(gpu("l40s").unwrap().memory_bytes, 46_068.0 * 1_048_576.0);
        assert_eq!(gpu("a10g").unwrap().memory_bytes, 23_028.0 * 1_048_576.0);
    }

    #[test]
    fn qwen3_32b_on_an_h100_holds_2198_blocks() {
        let m = model("Qwen/Qwen3-32B", None).unwrap();
        // KV per token: 2 (K, V) x 64 layers x 8 KV heads x 128 x 2 bytes = 262,144 (256 KiB);
        // a block of 16 tokens: 4 MiB = 4,194,304 bytes.
        assert_eq!(m.kv_bytes_per_token(), 262_144.0);
        // 81,559 MiB = 85,520,809,984 bytes; x 0.9 = 76,968,728,986
        // - weights 32.8e9 x 2 = 65,600,000,000 - reserve 2 GiB = 2,147,483,648
        // = 9,221,245,338 bytes / 4,194,304 = 2,198.5 -> 2,198 blocks (35,168 tokens)
        assert_eq!(num_gpu_blocks(gpu("h100").unwrap(), m, 0.9, 16), 2_198);
        // A100, 81,920 MiB = 85,899,345,920 x 0.9 = 77,309,411,328 - 65.6e9 - 2 GiB
        // = 9,561,927,680 / 4,194,304 = 2,279.7 -> 2,279 blocks
        assert_eq!(num_gpu_blocks(gpu("a100").unwrap(), m, 0.9, 16), 2_279);
        // with the 80e9 bytes these profiles said before: 72e9 - 65.6e9 - 2 GiB = 4,252,516,352
        // / 4,194,304 = 1,013 blocks, less than half
        let mut decimal = gpu("h100").unwrap().clone();
        decimal.memory_bytes = 80e9;
        assert_eq!(num_gpu_blocks(&decimal, m, 0.9, 16), 1_013);
    }

    #[test]
    fn llama_8b_on_an_a100_holds_28181_blocks() {
        let m = model("meta-llama/Llama-3.1-8B-Instruct", None).unwrap();
        // KV per token 2 x 32 x 8 x 128 x 2 = 131,072; a block of 16: 2 MiB = 2,097,152 bytes.
        // 85,899,345,920 x 0.9 = 77,309,411,328 - weights 8.03e9 x 2 = 16,060,000,000
        // - 2 GiB = 59,101,927,680 / 2,097,152 = 28,181.8 -> 28,181 blocks (450,896 tokens)
        assert_eq!(num_gpu_blocks(gpu("a100").unwrap(), m, 0.9, 16), 28_181);
        // the H100's 81,559 MiB: 76,968,728,986 - 16.06e9 - 2 GiB = 58,761,245,338
        // / 2,097,152 = 28,019.4 -> 28,019
        assert_eq!(num_gpu_blocks(gpu("h100").unwrap(), m, 0.9, 16), 28_019);
    }

    #[test]
    fn capacity_is_larger_on_bigger_memory() {
        let m = model("meta-llama/Llama-3.1-8B-Instruct", None).unwrap();
        let h = num_gpu_blocks(gpu("h100").unwrap(), m, 0.9, 16);
        let l = num_gpu_blocks(gpu("l40s").unwrap(), m, 0.9, 16);
        let a = num_gpu_blocks(gpu("a10g").unwrap(), m, 0.9, 16);
        // L40S: 46,068 MiB x 0.9 = 43,475,219,251 - 16.06e9 - 2 GiB = 25,267,735,603
        // / 2 MiB = 12,048 blocks; A10G: 23,028 MiB x 0.9 = 21,731,947,315 - 16.06e9 - 2 GiB
        // = 3,524,463,667 / 2 MiB = 1,680 blocks
        assert_eq!((l, a), (12_048, 1_680));
        assert!(h > l && l > a && a > 0, "{h} {l} {a}");
        // 32B weights do not fit a 24 GB card, nor with a useful cache a 48 GB one
        let big = model("Qwen/Qwen3-32B", None).unwrap();
        assert_eq!(num_gpu_blocks(gpu("a10g").unwrap(), big, 0.9, 16), 0);
        assert_eq!(num_gpu_blocks(gpu("l40s").unwrap(), big, 0.9, 16), 0);
    }
}
