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
    /// Device memory in bytes.
    pub memory_bytes: f64,
    /// Peak memory bandwidth in bytes/s.
    pub memory_bandwidth: f64,
    /// Dense (no sparsity) BF16 tensor-core peak in FLOP/s.
    pub bf16_flops: f64,
}

/// The built-in GPU profiles.
///
/// - H100 SXM5 80GB: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS dense BF16 (the datasheet's 1,979 is
///   with 2:4 sparsity). NVIDIA H100 Tensor Core GPU datasheet.
/// - A100 SXM4 80GB: 80 GB HBM2e, 2,039 GB/s, 312 TFLOPS dense BF16. NVIDIA A100 datasheet.
/// - L40S: 48 GB GDDR6, 864 GB/s, 362.05 TFLOPS dense BF16 (733 with sparsity). NVIDIA L40S
///   datasheet.
/// - A10 / A10G: 24 GB GDDR6, 600 GB/s, 125 TFLOPS dense BF16 (250 with sparsity). NVIDIA A10
///   datasheet; AWS's A10G (G5 instances) has the same 24 GB / 600 GB/s memory system, and AWS
///   does not publish a separate tensor figure, so the A10's is used.
pub const GPUS: &[GpuProfile] = &[
    GpuProfile {
        name: "h100",
        description: "NVIDIA H100 SXM5 80GB",
        memory_bytes: 80e9,
        memory_bandwidth: 3.35e12,
        bf16_flops: 989e12,
    },
    GpuProfile {
        name: "a100",
        description: "NVIDIA A100 SXM4 80GB",
        memory_bytes: 80e9,
        memory_bandwidth: 2.039e12,
        bf16_flops: 312e12,
    },
    GpuProfile {
        name: "l40s",
        description: "NVIDIA L40S 48GB",
        memory_bytes: 48e9,
        memory_bandwidth: 864e9,
        bf16_flops: 362.05e12,
    },
    GpuProfile {
        name: "a10g",
        description: "NVIDIA A10G / A10 24GB",
        memory_bytes: 24e9,
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
///   (`config.json`); fits one 80 GB GPU only with a small KV cache.
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
    fn capacity_is_larger_on_bigger_memory() {
        let m = model("meta-llama/Llama-3.1-8B-Instruct", None).unwrap();
        let h = num_gpu_blocks(gpu("h100").unwrap(), m, 0.9, 16);
        let l = num_gpu_blocks(gpu("l40s").unwrap(), m, 0.9, 16);
        let a = num_gpu_blocks(gpu("a10g").unwrap(), m, 0.9, 16);
        // H100: (72e9 - 16.06e9 - 2.15e9) / 2 MiB = ~25.6k blocks (~410k tokens)
        assert!(h > 25_000 && h < 26_000, "{h}");
        assert!(h > l && l > a && a > 0, "{h} {l} {a}");
        // 32B weights do not fit a 24 GB card
        let big = model("Qwen/Qwen3-32B", None).unwrap();
        assert_eq!(num_gpu_blocks(gpu("a10g").unwrap(), big, 0.9, 16), 0);
    }
}
