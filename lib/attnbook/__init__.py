"""attnbook: the tested library behind the book *Attention & Transformers*.

One module per concept, each standing on the ones before (imports only go downward):
utils -> masks -> positions -> attention -> multihead -> blocks -> models -> generation,
with data and train (datasets, the training loop), cost (formulas, timing), measure (timing
helpers), pretrained (MiniLM-L6 in our encoder), vit and speech (chapters 9 and 10), distributed
(the appendix: DDP and FSDP on gloo, imported on its own as ``attnbook.distributed``) and bench
(``python -m attnbook.bench``).
"""

from . import cost, data, measure, pretrained, speech, train, vit
from .attention import (
    AdditiveAttention,
    masked_softmax,
    memory_efficient_attention,
    scaled_dot_product_attention,
)
from .blocks import DecoderBlock, EncoderBlock, FeedForward
from .generation import generate, next_token
from .masks import causal_mask, combine_masks, padding_mask
from .models import GPT, EncoderDecoderModel, EncoderOnlyModel
from .multihead import (
    KVCache,
    MultiHeadAttention,
    RotaryMultiHeadAttention,
    WideMultiHeadAttention,
    merge_heads,
    split_heads,
)
from .positions import (
    LearnedPositions,
    SinusoidalPositions,
    apply_rope,
    interpolate_grid,
    sinusoidal_encoding,
)
from .speech import CTCModel, Seq2SeqSpeechModel, Transcriber, Whisper, log_mel_spectrogram
from .utils import device, generator, on_gpu, progress, seed_everything, seed_offset, show_source
from .vit import PatchEmbedding, SmallResNet, ViT

__all__ = [
    "AdditiveAttention",
    "DecoderBlock",
    "EncoderDecoderModel",
    "EncoderOnlyModel",
    "GPT",
    "EncoderBlock",
    "FeedForward",
    "generate",
    "next_token",
    "KVCache",
    "LearnedPositions",
    "MultiHeadAttention",
    "RotaryMultiHeadAttention",
    "SinusoidalPositions",
    "WideMultiHeadAttention",
    "apply_rope",
    "interpolate_grid",
    "merge_heads",
    "sinusoidal_encoding",
    "split_heads",
    "train",
    "causal_mask",
    "cost",
    "measure",
    "data",
    "pretrained",
    "combine_masks",
    "device",
    "masked_softmax",
    "memory_efficient_attention",
    "on_gpu",
    "padding_mask",
    "progress",
    "scaled_dot_product_attention",
    "seed_everything",
    "seed_offset",
    "generator",
    "show_source",
    "vit",
    "speech",
    "Whisper",
    "Transcriber",
    "CTCModel",
    "Seq2SeqSpeechModel",
    "log_mel_spectrogram",
    "ViT",
    "PatchEmbedding",
    "SmallResNet",
]
