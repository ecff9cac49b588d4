"""Published figures: GPU datasheets and model configs (config.json values).

Plain data so the schema module can validate it. GPU prices are rental
estimates (ANCHORS.md quotes 3.5-13 USD/h for H200 in 2026); everything else
is from vendor datasheets or the models' published config.json.
"""

from __future__ import annotations

# Nominal PCIe Gen5 x16 is 64 GB/s per direction (Gen4: 32). NVLink per GPU.
GPUS: dict[str, dict[str, float | str]] = {
    "h20": dict(memory_gb=96, hbm_tb_s=4.0, bf16_tflops=148, h2d_gb_s=64, nvlink_gb_s=900, usd_per_hour=1.8,
                source="NVIDIA H20 datasheet; price estimated"),
    "h20-3e": dict(memory_gb=141, hbm_tb_s=4.8, bf16_tflops=148, h2d_gb_s=64, nvlink_gb_s=900, usd_per_hour=2.2,
                   source="NVIDIA H20 (141 GB HBM3e) datasheet, vLLM PR #19205; price estimated"),
    "h100": dict(memory_gb=80, hbm_tb_s=3.35, bf16_tflops=989, h2d_gb_s=64, nvlink_gb_s=900, usd_per_hour=2.5,
                 source="NVIDIA H100 SXM datasheet; price estimated"),
    "h800": dict(memory_gb=80, hbm_tb_s=3.35, bf16_tflops=989, h2d_gb_s=64, nvlink_gb_s=400, usd_per_hour=2.5,
                 source="NVIDIA H800 SXM datasheet; price estimated"),
    "h200": dict(memory_gb=141, hbm_tb_s=4.8, bf16_tflops=989, h2d_gb_s=64, nvlink_gb_s=900, usd_per_hour=3.5,
                 source="NVIDIA H200 datasheet; price: low end of 2026 rentals (ANCHORS.md)"),
    "a100-80gb": dict(memory_gb=80, hbm_tb_s=2.0, bf16_tflops=312, h2d_gb_s=32, nvlink_gb_s=600, usd_per_hour=1.5,
                      source="NVIDIA A100 80GB SXM datasheet; price estimated"),
}

# Hugging Face config.json values. total_params is the published count where
# the model card gives one.
_QWEN2_VOCAB = 152064
_QWEN_SMALL_VOCAB = 151936
ARCHS: dict[str, dict[str, object]] = {
    "qwen1.5-1.8b": dict(family="qwen2", num_layers=24, hidden_size=2048, num_heads=16, num_kv_heads=16, intermediate_size=5504,
                         vocab_size=_QWEN_SMALL_VOCAB, qkv_bias=True, total_params=1.84e9, max_context=32768),
    "qwen2.5-0.5b": dict(family="qwen2", num_layers=24, hidden_size=896, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                         vocab_size=_QWEN_SMALL_VOCAB, tie_embeddings=True, qkv_bias=True, total_params=0.494e9, max_context=32768),
    "qwen2.5-1.5b": dict(family="qwen2", num_layers=28, hidden_size=1536, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                         vocab_size=_QWEN_SMALL_VOCAB, tie_embeddings=True, qkv_bias=True, total_params=1.54e9, max_context=32768),
    "qwen2.5-3b": dict(family="qwen2", num_layers=36, hidden_size=2048, num_heads=16, num_kv_heads=2, intermediate_size=11008,
                       vocab_size=_QWEN_SMALL_VOCAB, tie_embeddings=True, qkv_bias=True, total_params=3.09e9, max_context=32768),
    "qwen2.5-7b": dict(family="qwen2", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, intermediate_size=18944,
                       vocab_size=_QWEN2_VOCAB, qkv_bias=True, total_params=7.61e9, max_context=32768),
    "qwen2.5-14b": dict(family="qwen2", num_layers=48, hidden_size=5120, num_heads=40, num_kv_heads=8, intermediate_size=13824,
                        vocab_size=_QWEN2_VOCAB, qkv_bias=True, total_params=14.7e9, max_context=32768),
    "qwen2.5-32b": dict(family="qwen2", num_layers=64, hidden_size=5120, num_heads=40, num_kv_heads=8, intermediate_size=27648,
                        vocab_size=_QWEN2_VOCAB, qkv_bias=True, total_params=32.5e9, max_context=32768),
    "qwen2.5-72b": dict(family="qwen2", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, intermediate_size=29568,
                        vocab_size=_QWEN2_VOCAB, qkv_bias=True, total_params=72.7e9, max_context=32768),
    "qwen3-1.7b": dict(family="qwen3", num_layers=28, hidden_size=2048, num_heads=16, num_kv_heads=8, head_dim=128,
                       intermediate_size=6144, vocab_size=_QWEN_SMALL_VOCAB, tie_embeddings=True, total_params=1.72e9, max_context=40960),
    "qwen3-4b": dict(family="qwen3", num_layers=36, hidden_size=2560, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=9728, vocab_size=_QWEN_SMALL_VOCAB, tie_embeddings=True, total_params=4.02e9, max_context=40960),
    "qwen3-8b": dict(family="qwen3", num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=12288, vocab_size=_QWEN_SMALL_VOCAB, total_params=8.19e9, max_context=40960),
    "qwen3-14b": dict(family="qwen3", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=8, head_dim=128,
                      intermediate_size=17408, vocab_size=_QWEN_SMALL_VOCAB, total_params=14.8e9, max_context=40960),
    "qwen3-32b": dict(family="qwen3", num_layers=64, hidden_size=5120, num_heads=64, num_kv_heads=8, head_dim=128,
                      intermediate_size=25600, vocab_size=_QWEN_SMALL_VOCAB, total_params=32.8e9, max_context=40960),
    "qwen3-30b-a3b": dict(family="qwen3_moe", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                          intermediate_size=768, num_experts=128, experts_per_token=8, vocab_size=_QWEN_SMALL_VOCAB,
                          total_params=30.5e9, max_context=40960),
    "llama-2-7b": dict(family="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, intermediate_size=11008,
                       vocab_size=32000, total_params=6.74e9, max_context=4096),
    "llama-2-13b": dict(family="llama", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40, intermediate_size=13824,
                        vocab_size=32000, total_params=13.0e9, max_context=4096),
    "llama-2-70b": dict(family="llama", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, intermediate_size=28672,
                        vocab_size=32000, total_params=69.0e9, max_context=4096),
    "llama-3.2-1b": dict(family="llama", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64,
                         intermediate_size=8192, vocab_size=128256, tie_embeddings=True, total_params=1.24e9, max_context=131072),
    "llama-3.2-3b": dict(family="llama", num_layers=28, hidden_size=3072, num_heads=24, num_kv_heads=8, head_dim=128,
                         intermediate_size=8192, vocab_size=128256, tie_embeddings=True, total_params=3.21e9, max_context=131072),
    "llama-3.1-8b": dict(family="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                         vocab_size=128256, total_params=8.03e9, max_context=131072),
    "llama-3.1-70b": dict(family="llama", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, intermediate_size=28672,
                          vocab_size=128256, total_params=70.6e9, max_context=131072),
    "mistral-7b": dict(family="mistral", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                       vocab_size=32768, total_params=7.25e9, max_context=32768),
    "yi-1.5-6b": dict(family="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=4, intermediate_size=11008,
                      vocab_size=64000, total_params=6.06e9, max_context=4096),
    "yi-1.5-9b": dict(family="llama", num_layers=48, hidden_size=4096, num_heads=32, num_kv_heads=4, intermediate_size=11008,
                      vocab_size=64000, total_params=8.83e9, max_context=4096),
    "yi-1.5-34b": dict(family="llama", num_layers=60, hidden_size=7168, num_heads=56, num_kv_heads=8, intermediate_size=20480,
                       vocab_size=64000, total_params=34.4e9, max_context=4096),
}
