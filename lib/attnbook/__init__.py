"""attnbook: the tested library behind the book *Attention & Transformers*.

One module per concept, each standing on the ones before (imports only go downward):
utils -> masks -> positions -> attention -> multihead -> blocks -> models -> generation -> ...
"""

from .attention import (
    AdditiveAttention,
    masked_softmax,
    memory_efficient_attention,
    scaled_dot_product_attention,
)
from .masks import causal_mask, combine_masks, padding_mask
from .utils import device, on_gpu, progress, seed_everything, show_source

__all__ = [
    "AdditiveAttention",
    "causal_mask",
    "combine_masks",
    "device",
    "masked_softmax",
    "memory_efficient_attention",
    "on_gpu",
    "padding_mask",
    "progress",
    "scaled_dot_product_attention",
    "seed_everything",
    "show_source",
]
