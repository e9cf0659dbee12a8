"""attnbook: the tested library behind the book *Attention & Transformers*.

One module per concept, each standing on the ones before (imports only go downward):
utils -> masks -> positions -> attention -> multihead (chapter 3, with chapter 4's
RoPE) -> modern (chapter 17: RMSNorm, SwiGLU, grouped-query attention) -> experts
(chapter 19: mixture of experts) -> blocks (chapter 5) -> quantize, caches, paging
(chapters 8 and 18: the KV caches on one base, their quantisation and the paged block
pool) -> latent (chapter 18: DeepSeek's multi-head latent attention) -> convert
(reading transformers' Llama, Qwen3, Mistral, Mixtral and DeepSeek-V3) -> models
(chapter 6: the three families; a GPT built from a config) -> generation (the decoding
loops on one step function). Beside them: data and train (datasets, the training
loop), cost (formulas), measure (timing helpers), bert (MiniLM-L6 in our encoder), vit
(chapter 9), audio, whisper, ctc and metrics (chapter 10), flash (chapter 15:
FlashAttention), interpretability (chapter 16: induction heads), linear (chapter 20:
linear attention; above multihead), ssm (chapter 20: a Mamba block; on utils alone),
distributed (the appendix: DDP and FSDP on gloo, imported on its own as
``attnbook.distributed``) and bench (``python -m attnbook.bench``).
"""

from . import (
    audio,
    bert,
    convert,
    cost,
    ctc,
    data,
    experts,
    measure,
    metrics,
    modern,
    paging,
    quantize,
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
from .blocks import Block, DecoderBlock, DecoderOnlyBlock, EncoderBlock, FeedForward
from .caches import (
    KVCache,
    LatentKVCache,
    QuantizedKVCache,
    RollingKVCache,
    make_caches,
)
from .ctc import (
    ctc_best_alignment,
    ctc_greedy_decode,
    ctc_log_alpha,
    ctc_loss,
    ctc_prefix_beam_search,
)
from .experts import MoEFeedForward, record_routing
from .flash import flash_attention
from .generation import (
    PromptLookupDraft,
    SpeculativeStats,
    accept_drafts,
    beam_search,
    generate,
    generate_paged,
    next_token,
    sampling_probabilities,
    speculative_generate,
    truncate_logits,
)
from .gguf import GGUFTokenizer, load_gguf, load_gguf_tokenizer, smollm2
from .interpretability import ablate_heads, induction_score, previous_token_score
from .latent import MultiHeadLatentAttention
from .linear import LinearAttention, linear_attention, linear_attention_recurrent
from .masks import causal_mask, combine_masks, padding_mask, sliding_window_mask
from .metrics import error_rate
from .mixers import MixerModel
from .models import (
    GPT,
    EncoderDecoderModel,
    EncoderOnlyModel,
    GPTConfig,
    TransformerDecoder,
    mean_pool,
)
from .modern import GroupedQueryAttention, RMSNorm, SwiGLU, repeat_kv
from .multihead import (
    MultiHeadAttention,
    RotaryMultiHeadAttention,
    WideMultiHeadAttention,
    merge_heads,
    split_heads,
)
from .paging import BlockPool, PagedKVCache, paged_memory_waste
from .positions import (
    LearnedPositions,
    Rotary,
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
from .quantize import QuantizedTensor, dequantize_kv, quantize_kv
from .speech import CTCModel, Seq2SeqSpeechModel
from .ssm import MambaBlock
from .utils import (
    device,
    generator,
    on_gpu,
    progress,
    seed_everything,
    seed_offset,
    shifted_seed,
    show_source,
)
from .vit import PatchEmbedding, SmallResNet, ViT
from .whisper import Transcriber, Whisper, load_whisper_tiny_en

__all__ = [
    "AdditiveAttention",
    "BertEncoder",
    "Block",
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
    "GPTConfig",
    "GroupedQueryAttention",
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
    "PromptLookupDraft",
    "QuantizedKVCache",
    "QuantizedTensor",
    "RMSNorm",
    "RollingKVCache",
    "Rotary",
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
    "ablate_heads",
    "accept_drafts",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "audio",
    "beam_search",
    "bert",
    "bound_phrase",
    "causal_mask",
    "combine_masks",
    "convert",
    "cost",
    "count_phrase",
    "ctc",
    "ctc_best_alignment",
    "ctc_greedy_decode",
    "ctc_log_alpha",
    "ctc_loss",
    "ctc_prefix_beam_search",
    "data",
    "dequantize_kv",
    "device",
    "error_rate",
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
    "paging",
    "percent_phrase",
    "previous_token_score",
    "progress",
    "quantize",
    "quantize_kv",
    "record_routing",
    "repeat_kv",
    "rope_angles",
    "rope_scores",
    "sampling_probabilities",
    "scaled_dot_product_attention",
    "seed_everything",
    "seed_offset",
    "shifted_seed",
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
