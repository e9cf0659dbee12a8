"""A selective state-space block: Mamba (Gu & Dao, 2023; chapter 20), equal to
transformers' ``MambaMixer`` at the same weights.

For ``x (B, T, d_model)``, with ``E = expand d_model`` channels and ``N = state_size``
numbers of state per channel:

1. ``in_proj``: ``x -> (u, z)``, two ``(B, T, E)``: the signal and the gate;
2. ``u = SiLU(conv1d(u))``: a causal depthwise convolution over the last
   ``conv_kernel`` tokens;
3. ``x_proj``: ``u -> (dt (dt_rank), B_t (N), C_t (N))``, then ``Delta =
   softplus(dt_proj(dt)) (E)``: the selection, different at every token;
4. the scan, per channel ``e``: ``h_t = exp(Delta_t A) h_{t-1} + Delta_t B_t u_t``
   (``h_t (E, N)``, ``A = -exp(A_log)``), ``y_t = h_t C_t + D u_t``;
5. ``out_proj(y * SiLU(z))``.

Two ways to compute it: :meth:`MambaBlock.forward` (and :meth:`~MambaBlock.prefill`)
on a whole sequence, every step on all tokens at once but the scan (:func:`scan`: on
a GPU in ``ceil(log2 T)`` rounds, on a CPU a loop over the tokens); and
:meth:`MambaBlock.step`, the recurrence on one token, carrying a :class:`MambaState`:
the last ``conv_kernel - 1`` inputs of the convolution and ``h``. Its size, ``B E
(conv_kernel - 1 + N)`` numbers a layer, does not grow with the sequence
(:meth:`MambaBlock.state_bytes`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .utils import check_positive_int, copy_weights


class MambaState(NamedTuple):
    """A :class:`MambaBlock`'s recurrent state: ``conv (B, E, conv_kernel - 1)``, the
    convolution's last inputs, and ``ssm (B, E, N)``, the state ``h``."""

    conv: torch.Tensor
    ssm: torch.Tensor


def scan(a, b, initial=None, *, parallel=None):
    """All states of ``h_t = a_t h_{t-1} + b_t`` (``h_{-1} = initial``, default 0):
    ``a, b (B, T, ...)`` -> ``h (B, T, ...)``, time on dim 1.

    Two ways, the same states: ``parallel=True``, Hillis and Steele's scan
    (:func:`_hillis_steele`), ``ceil(log2 T)`` rounds of whole-tensor operations and
    about ``T log2 T`` steps' work, what a GPU running every position at once wants;
    ``parallel=False``, the loop over ``t`` (:func:`_loop`), ``T`` steps and no more
    work, faster on a CPU. ``None``: the rounds on a GPU, the loop elsewhere. Either
    way the gradient is the same scan run backwards in time (:class:`_Scan`), so
    autograd need not record every step.
    """
    if parallel is None:
        parallel = a.is_cuda
    if initial is not None:  # h_0 = a_0 initial + b_0: fold the start into b_0
        b = torch.cat([b[:, :1] + a[:, :1] * initial.unsqueeze(1), b[:, 1:]], 1)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _Scan.apply(a, b, parallel)
    return (_hillis_steele if parallel else _loop)(a, b)


def parallel_scan(a, b, initial=None):
    """:func:`scan` in ``ceil(log2 T)`` rounds (``parallel=True``), on any device."""
    return scan(a, b, initial, parallel=True)


def _loop(a, b, *, reverse=False):
    """The scan from ``h_{-1} = 0``, one step at a time; ``reverse=True`` runs it
    backwards in time, ``h_t = a_t h_{t+1} + b_t`` (from ``h_T = 0``)."""
    h, state = torch.empty_like(b), None
    for t in reversed(range(a.shape[1])) if reverse else range(a.shape[1]):
        state = b[:, t] if state is None else torch.addcmul(b[:, t], a[:, t], state)
        h[:, t] = state
    return h


def _hillis_steele(a, b, *, reverse=False):
    """The scan from ``h_{-1} = 0``: after the round with ``shift = s``, ``b_t`` holds
    the recurrence run over the ``2 s`` steps ending at ``t`` and ``a_t`` the product
    of their ``a``. ``reverse=True`` runs it backwards in time, ``h_t = a_t h_{t+1} +
    b_t`` (from ``h_T = 0``)."""
    a, b, shift = a.clone(), b.clone(), 1
    while shift < a.shape[1]:
        late, early = slice(shift, None), slice(None, -shift)
        to, source = (early, late) if reverse else (late, early)  # h_t reads h_{t -+ s}
        b[:, to] += a[:, to] * b[:, source]  # the product is taken before b changes
        a[:, to] = a[:, to] * a[:, source]
        shift *= 2
    return b


class _Scan(torch.autograd.Function):
    """:func:`scan` with its gradient written out. With ``g_t = dL/dh_t`` summed over
    every later state, ``g_t = grad_t + a_{t+1} g_{t+1}``: the same scan, backwards in
    time. Then ``dL/db_t = g_t`` and ``dL/da_t = g_t h_{t-1}``. (Autograd through the
    steps would allocate a full-size tensor of zeros per slice.)"""

    @staticmethod
    def forward(ctx, a, b, parallel):
        run = _hillis_steele if parallel else _loop
        h = run(a, b)
        ctx.run = run
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, h = ctx.saved_tensors
        a_next = torch.empty_like(a)  # a_{t+1}, 0 after the last step
        a_next[:, :-1], a_next[:, -1] = a[:, 1:], 0
        g = ctx.run(a_next, grad.contiguous(), reverse=True)
        grad_a = torch.empty_like(g)  # g_t h_{t-1}, with h_{-1} = 0
        grad_a[:, 0] = 0
        torch.mul(g[:, 1:], h[:, :-1], out=grad_a[:, 1:])
        return grad_a, g, None


class MambaBlock(nn.Module):
    """Mamba's mixer (see the module docstring): ``forward(x (B, T, d_model)) -> (B, T,
    d_model)``, ``step(x_t (B, d_model), state) -> (y_t (B, d_model), state)``.

    The parameters have ``MambaMixer``'s names and shapes (``in_proj``, ``conv1d``,
    ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``) and its initialisation:
    ``A = -(1, 2, ..., N)`` in every channel, ``D = 1``, ``Delta`` between 0.001 and
    0.1 at the start. ``dt_rank`` defaults to ``ceil(d_model / 16)``; ``bias`` is that
    of ``in_proj`` and ``out_proj``. The scan runs in float32 for fp16 / bf16 inputs.
    """

    def __init__(
        self,
        d_model: int,
        *,
        state_size: int = 16,
        expand: int = 2,
        conv_kernel: int = 4,
        dt_rank: int | None = None,
        bias: bool = False,
        conv_bias: bool = True,
    ):
        super().__init__()
        self.d_model = check_positive_int("d_model", d_model)
        self.state_size = N = check_positive_int("state_size", state_size)
        self.inner_size = E = check_positive_int("expand", expand) * d_model
        self.conv_kernel = check_positive_int("conv_kernel", conv_kernel)
        self.dt_rank = (
            math.ceil(d_model / 16)
            if dt_rank is None
            else check_positive_int("dt_rank", dt_rank)
        )
        self.in_proj = nn.Linear(d_model, 2 * E, bias=bias)
        self.conv1d = nn.Conv1d(E, E, conv_kernel, groups=E, bias=conv_bias)
        self.x_proj = nn.Linear(E, self.dt_rank + 2 * N, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, E)
        self.A_log = nn.Parameter(torch.arange(1.0, N + 1).log().repeat(E, 1))
        self.D = nn.Parameter(torch.ones(E))
        self.out_proj = nn.Linear(E, d_model, bias=bias)
        with torch.no_grad():  # Delta = softplus(bias) log-uniform in [0.001, 0.1]
            nn.init.uniform_(
                self.dt_proj.weight, -(self.dt_rank**-0.5), self.dt_rank**-0.5
            )
            dt = torch.exp(torch.rand(E) * math.log(100) + math.log(1e-3))
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    @classmethod
    def from_transformers(cls, mixer) -> MambaBlock:
        """A block with the weights of a transformers ``MambaMixer``, on its device and
        in its dtype, computing the same outputs."""
        config = mixer.config
        if config.hidden_act != "silu":
            raise ValueError(
                f"MambaBlock uses SiLU, the mixer has {config.hidden_act!r}"
            )
        if mixer.intermediate_size % mixer.hidden_size:
            raise ValueError(
                f"intermediate_size={mixer.intermediate_size} is not a multiple of "
                f"hidden_size={mixer.hidden_size}"
            )
        block = cls(
            mixer.hidden_size,
            state_size=mixer.ssm_state_size,
            expand=mixer.intermediate_size // mixer.hidden_size,
            conv_kernel=mixer.conv_kernel_size,
            dt_rank=mixer.time_step_rank,
            bias=config.use_bias,
            conv_bias=config.use_conv_bias,
        )
        parameter = mixer.A_log
        block.to(device=parameter.device, dtype=parameter.dtype)
        return copy_weights(block, dict(mixer.named_parameters()))

    def _check(self, x, dims):
        shape = "(B, T, d_model)" if dims == 3 else "(B, d_model)"
        if (
            not isinstance(x, torch.Tensor)
            or x.dim() != dims
            or x.shape[-1] != self.d_model
        ):
            raise ValueError(
                f"x must be {shape} with d_model={self.d_model}, got "
                f"{tuple(getattr(x, 'shape', ()))}"
            )

    def zero_state(
        self, batch_size: int, device=None, dtype=torch.float32
    ) -> MambaState:
        """The state before the first token: zeros (the convolution's left padding)."""
        batch_size = check_positive_int("batch_size", batch_size)
        E, k = self.inner_size, self.conv_kernel
        return MambaState(
            torch.zeros(batch_size, E, k - 1, device=device, dtype=dtype),
            torch.zeros(batch_size, E, self.state_size, device=device, dtype=dtype),
        )

    def _state(self, state, x):
        if state is None:
            return self.zero_state(x.shape[0], x.device, x.dtype)
        conv = (x.shape[0], self.inner_size, self.conv_kernel - 1)
        ssm = (x.shape[0], self.inner_size, self.state_size)
        if tuple(state.conv.shape) != conv or tuple(state.ssm.shape) != ssm:
            raise ValueError(
                f"state must be MambaState(conv {conv}, ssm {ssm}), got "
                f"{tuple(state.conv.shape)} and {tuple(state.ssm.shape)}"
            )
        return state

    def _selection(self, u):
        """``u (..., E)`` -> ``Delta (..., E)``, ``B (..., N)``, ``C (..., N)``."""
        N = self.state_size
        dt, B, C = self.x_proj(u).split([self.dt_rank, N, N], dim=-1)
        return F.softplus(self.dt_proj(dt)), B, C

    def forward(self, x):
        """``x (B, T, d_model)`` -> ``(B, T, d_model)``, from the zero state."""
        return self.prefill(x)[0]

    def prefill(self, x, state=None):
        """The whole-sequence form: ``x (B, T, d_model)`` -> ``(y (B, T, d_model),
        state)``, starting from ``state`` (default zeros); the state returned is the
        one :meth:`step` continues from."""
        self._check(x, 3)
        state = self._state(state, x)
        u, z = self.in_proj(x).chunk(2, dim=-1)  # (B, T, E) each
        # the convolution sees the last k - 1 inputs before this chunk
        window = torch.cat([state.conv.to(u.dtype), u.transpose(1, 2)], -1)
        conv = F.conv1d(
            window, self.conv1d.weight, self.conv1d.bias, groups=u.shape[-1]
        )
        u = F.silu(conv).transpose(1, 2)  # (B, T, E)
        delta, B, C = self._selection(u)
        f32 = torch.promote_types(x.dtype, torch.float32)
        A = -torch.exp(self.A_log.to(f32))  # (E, N)
        delta, B, C, u32 = delta.to(f32), B.to(f32), C.to(f32), u.to(f32)
        a = torch.exp(delta[..., None] * A)  # (B, T, E, N)
        b = (delta * u32)[..., None] * B[:, :, None, :]  # (B, T, E, N)
        h = scan(a, b, state.ssm.to(f32))  # (B, T, E, N)
        y = (h @ C[..., None]).squeeze(-1) + self.D * u32  # (B, T, E)
        y = (y * F.silu(z.to(f32))).to(x.dtype)
        kept = window[..., window.shape[-1] - (self.conv_kernel - 1) :]  # last k - 1
        return self.out_proj(y), MambaState(kept, h[:, -1])

    def step(self, x, state=None):
        """The recurrent form, one token: ``x (B, d_model)`` and the state after the
        tokens before it -> ``(y (B, d_model), state)``."""
        self._check(x, 2)
        state = self._state(state, x)
        u, z = self.in_proj(x).chunk(2, dim=-1)  # (B, E) each
        window = torch.cat([state.conv.to(u.dtype), u[..., None]], -1)  # (B, E, k)
        u = (window * self.conv1d.weight[:, 0]).sum(-1)
        if self.conv1d.bias is not None:
            u = u + self.conv1d.bias
        u = F.silu(u)  # (B, E)
        delta, B, C = self._selection(u)
        f32 = torch.promote_types(x.dtype, torch.float32)
        A = -torch.exp(self.A_log.to(f32))  # (E, N)
        delta, B, C, u32 = delta.to(f32), B.to(f32), C.to(f32), u.to(f32)
        h = torch.exp(delta[..., None] * A) * state.ssm.to(f32)  # (B, E, N)
        h = h + (delta * u32)[..., None] * B[:, None, :]
        y = (h @ C[..., None]).squeeze(-1) + self.D * u32  # (B, E)
        y = (y * F.silu(z.to(f32))).to(x.dtype)
        return self.out_proj(y), MambaState(window[..., 1:], h)

    def state_bytes(self, batch_size: int = 1, dtype=torch.float32) -> int:
        """Bytes of the recurrent state of this layer: ``batch_size E (conv_kernel - 1 +
        N)`` numbers of ``dtype``, for any sequence length."""
        batch_size = check_positive_int("batch_size", batch_size)
        numbers = self.inner_size * (self.conv_kernel - 1 + self.state_size)
        return batch_size * numbers * torch.empty((), dtype=dtype).element_size()


__all__ = ["MambaBlock", "MambaState", "parallel_scan", "scan"]
