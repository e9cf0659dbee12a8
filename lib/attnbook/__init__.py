"""attnbook: the tested library behind the book *Attention & Transformers*.

One module per concept, each standing on the ones before (imports only go downward):
utils -> masks -> positions -> attention -> multihead -> blocks -> models -> generation,
with modern (chapter 17: RMSNorm, SwiGLU, RoPE's two layouts, reading transformers'
Llama, Qwen3, Mistral and DeepSeek-V3; below multihead), data and train (datasets, the
training loop), cost (formulas, timing), measure (timing helpers), bert (MiniLM-L6 in
our encoder), vit (chapter 9), audio, whisper, ctc and metrics (chapter 10), flash
(chapter 15: FlashAttention), interpretability (chapter 16: induction heads), latent
(chapter 18: DeepSeek's multi-head latent attention; between multihead and models),
experts (chapter 19: mixture of experts, reading transformers' Mixtral; between modern
and blocks),
linear (chapter 20: linear attention; above multihead), ssm (chapter 20: a Mamba
block; on utils alone),
distributed (the appendix: DDP and FSDP on gloo, imported on its own as
``attnbook.distributed``) and bench (``python -m attnbook.bench``).
"""

from . import (
    audio,
    bert,
    cost,
    ctc,
    data,
    experts,
    measure,
    metrics,
    modern,
    speech,
    train,
    vit,
    whisper,
)
from .attention import (
    AdditiveAttention,
    masked_softmax,
    memory_efficient_attention,
    scaled_dot_product_attention,
)
from .audio import log_mel_spectrogram
from .bert import BertEncoder, load_minilm
from .blocks import DecoderBlock, DecoderOnlyBlock, EncoderBlock, FeedForward
from .caches import (
    BlockPool,
    KVCache,
    LatentKVCache,
    PagedKVCache,
    QuantizedKVCache,
    QuantizedTensor,
    RollingKVCache,
    dequantize_kv,
    make_caches,
    paged_memory_waste,
    quantize_kv,
)
from .ctc import (
    ctc_best_alignment,
    ctc_log_alpha,
    ctc_loss,
    ctc_prefix_beam_search,
)
from .experts import MoEFeedForward
from .flash import flash_attention
from .generation import (
    SpeculativeStats,
    beam_search,
    generate,
    generate_paged,
    next_token,
    sampling_probabilities,
    speculative_generate,
    truncate_logits,
)
from .gguf import GGUFTokenizer, load_gguf, load_gguf_tokenizer, smollm2
from .interpretability import induction_score, previous_token_score
from .latent import MultiHeadLatentAttention
from .linear import LinearAttention, linear_attention, linear_attention_recurrent
from .masks import causal_mask, combine_masks, padding_mask, sliding_window_mask
from .mixers import MixerModel
from .models import (
    GPT,
    EncoderDecoderModel,
    EncoderOnlyModel,
    TransformerDecoder,
    mean_pool,
)
from .modern import RMSNorm, SwiGLU
from .multihead import (
    MultiHeadAttention,
    RotaryMultiHeadAttention,
    WideMultiHeadAttention,
    merge_heads,
    repeat_kv,
    split_heads,
)
from .positions import (
    LearnedPositions,
    SinusoidalPositions,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    interpolate_grid,
    log_length_scale,
    rope_angles,
    rope_scores,
    sinusoidal_encoding,
    yarn_attention_factor,
)
from .prose import bound_phrase, count_phrase, more_or_less, percent_phrase
from .speech import CTCModel, Seq2SeqSpeechModel
from .ssm import MambaBlock
from .utils import (
    device,
    generator,
    on_gpu,
    progress,
    seed_everything,
    seed_offset,
    show_source,
)
from .vit import PatchEmbedding, SmallResNet, ViT
from .whisper import Transcriber, Whisper, load_whisper_tiny_en

__all__ = [
    "AdditiveAttention",
    "BertEncoder",
    "BlockPool",
    "CTCModel",
    "DecoderBlock",
    "DecoderOnlyBlock",
    "EncoderBlock",
    "EncoderDecoderModel",
    "EncoderOnlyModel",
    "FeedForward",
    "GGUFTokenizer",
    "GPT",
    "KVCache",
    "LatentKVCache",
    "LearnedPositions",
    "LinearAttention",
    "MambaBlock",
    "MixerModel",
    "MoEFeedForward",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "PagedKVCache",
    "PatchEmbedding",
    "QuantizedKVCache",
    "QuantizedTensor",
    "RMSNorm",
    "RollingKVCache",
    "RotaryMultiHeadAttention",
    "Seq2SeqSpeechModel",
    "SinusoidalPositions",
    "SmallResNet",
    "SpeculativeStats",
    "SwiGLU",
    "Transcriber",
    "TransformerDecoder",
    "ViT",
    "Whisper",
    "WideMultiHeadAttention",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "audio",
    "beam_search",
    "bert",
    "bound_phrase",
    "causal_mask",
    "combine_masks",
    "cost",
    "count_phrase",
    "ctc",
    "ctc_best_alignment",
    "ctc_log_alpha",
    "ctc_loss",
    "ctc_prefix_beam_search",
    "data",
    "dequantize_kv",
    "device",
    "experts",
    "flash_attention",
    "generate",
    "generate_paged",
    "generator",
    "induction_score",
    "interpolate_grid",
    "linear_attention",
    "linear_attention_recurrent",
    "load_gguf",
    "load_gguf_tokenizer",
    "load_minilm",
    "load_whisper_tiny_en",
    "log_length_scale",
    "log_mel_spectrogram",
    "make_caches",
    "masked_softmax",
    "mean_pool",
    "measure",
    "memory_efficient_attention",
    "merge_heads",
    "metrics",
    "modern",
    "more_or_less",
    "next_token",
    "on_gpu",
    "padding_mask",
    "paged_memory_waste",
    "percent_phrase",
    "previous_token_score",
    "progress",
    "quantize_kv",
    "repeat_kv",
    "rope_angles",
    "rope_scores",
    "sampling_probabilities",
    "scaled_dot_product_attention",
    "seed_everything",
    "seed_offset",
    "show_source",
    "sinusoidal_encoding",
    "sliding_window_mask",
    "smollm2",
    "speculative_generate",
    "speech",
    "split_heads",
    "train",
    "truncate_logits",
    "vit",
    "whisper",
    "yarn_attention_factor",
]
