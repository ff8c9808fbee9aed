"""``nn.MultiheadAttention`` with its projections as four linear layers, so that each can be
quantized (and calibrated) like any other ``nn.Linear``.

``nn.MultiheadAttention`` keeps the query, key and value projections in one packed
``in_proj_weight`` and calls ``F.linear`` on it (and on ``out_proj.weight``) inside
``F.multi_head_attention_forward``: no linear module runs, so none can be replaced by a
:class:`~torch_bridge.QuantizedLinear` or observed by a calibration hook.
:class:`SplitMultiheadAttention` computes the same function with four child modules
``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj``; :func:`~torch_bridge.quantize_model` puts
one in place of each ``nn.MultiheadAttention`` before it converts the linear layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["SplitMultiheadAttention", "why_not_split"]


def why_not_split(attention: torch.nn.MultiheadAttention) -> str | None:
    """Why ``attention`` cannot be split into four linear layers (None: it can)."""
    if type(attention).forward is not torch.nn.MultiheadAttention.forward:
        return (f"{type(attention).__name__} overrides nn.MultiheadAttention.forward: "
                "splitting it would drop its behaviour")
    if attention.bias_k is not None or attention.add_zero_attn:
        return "add_bias_kv and add_zero_attn are not supported by SplitMultiheadAttention"
    return None


def _float_mask(mask: torch.Tensor | None, name: str, dtype) -> torch.Tensor | None:
    """A boolean mask (True: not attended) as an additive float mask (``-inf`` where True); a
    float mask as it is (what ``nn.MultiheadAttention`` does with its masks)."""
    if mask is None or torch.is_floating_point(mask):
        return mask
    if mask.dtype != torch.bool:
        raise TypeError(f"SplitMultiheadAttention: {name} must be a bool or floating tensor, "
                        f"got {mask.dtype}")
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


class SplitMultiheadAttention(torch.nn.Module):
    """Multi-head attention whose four projections are modules: ``nn.MultiheadAttention``'s
    function and call signature, without ``add_bias_kv`` / ``add_zero_attn``.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` takes and returns what
    ``nn.MultiheadAttention.forward`` does (``(L, N, E)`` inputs, ``(N, L, E)`` with
    ``batch_first``, or unbatched ``(L, E)``; boolean or float masks; the attention weights
    averaged over heads or per head when ``need_weights``, else ``None``). The attention
    itself is ``F.scaled_dot_product_attention`` (or, when the weights are returned, the same
    softmax product written out, as torch does); only the projections are ``q_proj(query)``,
    ``k_proj(key)``, ``v_proj(value)`` and ``out_proj(...)``. For ``nn.TransformerEncoderLayer``
    the module reads as an attention with separate projection weights
    (``_qkv_same_embed_dim`` false), so the layer takes its standard (non-fused) path.

    Args:
      q_proj, k_proj, v_proj: modules mapping ``[..., E]``, ``[..., kdim]``, ``[..., vdim]`` to
        ``[..., E]`` (``nn.Linear`` or :class:`~torch_bridge.QuantizedLinear`).
      out_proj: a module mapping ``[..., E]`` to ``[..., E]``.
      num_heads: heads; ``E`` must be divisible by it.
      dropout: dropout probability on the attention weights (training mode only).
      batch_first: inputs and outputs are ``(N, L, E)`` rather than ``(L, N, E)``.
    """

    def __init__(self, q_proj: torch.nn.Module, k_proj: torch.nn.Module,
                 v_proj: torch.nn.Module, out_proj: torch.nn.Module, num_heads: int, *,
                 dropout: float = 0.0, batch_first: bool = False):
        super().__init__()
        sizes = [(getattr(m, "in_features", None), getattr(m, "out_features", None))
                 for m in (q_proj, k_proj, v_proj, out_proj)]
        embed_dim = sizes[0][1]
        if (any(not isinstance(v, int) for s in sizes for v in s)
                or {s[1] for s in sizes} != {embed_dim} or sizes[0][0] != embed_dim
                or sizes[3][0] != embed_dim):
            raise ValueError(f"SplitMultiheadAttention: expected linear projections q [E, E], "
                             f"k [E, kdim], v [E, vdim], out [E, E] (out, in), got "
                             f"{[(o, i) for i, o in sizes]}")
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 \
                or embed_dim % num_heads:
            raise ValueError(f"SplitMultiheadAttention: num_heads must be an int >= 1 dividing "
                             f"embed_dim = {embed_dim}, got {num_heads!r}")
        if not isinstance(batch_first, bool):
            raise TypeError(f"SplitMultiheadAttention: batch_first must be a bool, got "
                            f"{batch_first!r}")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"SplitMultiheadAttention: dropout must be in [0, 1], got "
                             f"{dropout!r}")
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = q_proj, k_proj, v_proj, out_proj
        self.embed_dim, self.kdim, self.vdim = embed_dim, sizes[1][0], sizes[2][0]
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.dropout, self.batch_first = float(dropout), batch_first
        # What nn.TransformerEncoder(Layer) reads to choose its fused path: separate
        # projections and no packed parameters, so it keeps to the standard one.
        self._qkv_same_embed_dim = False
        self.in_proj_weight = self.in_proj_bias = None

    @classmethod
    def from_attention(cls, attention: torch.nn.MultiheadAttention) -> SplitMultiheadAttention:
        """The same attention with its projections as four float ``nn.Linear`` layers (copies
        of ``attention``'s weights, on their device and dtype).

        Raises:
          TypeError: not an ``nn.MultiheadAttention``.
          ValueError: one that :func:`why_not_split` refuses.
        """
        if not isinstance(attention, torch.nn.MultiheadAttention):
            raise TypeError(f"SplitMultiheadAttention.from_attention: expected an "
                            f"nn.MultiheadAttention, got {type(attention).__name__}")
        why = why_not_split(attention)
        if why is not None:
            raise ValueError(f"SplitMultiheadAttention.from_attention: {why}")
        e = attention.embed_dim
        if attention._qkv_same_embed_dim:
            weights = attention.in_proj_weight.detach().split(e)
        else:
            weights = (attention.q_proj_weight.detach(), attention.k_proj_weight.detach(),
                       attention.v_proj_weight.detach())
        biases = ((None,) * 3 if attention.in_proj_bias is None
                  else attention.in_proj_bias.detach().split(e))
        out = attention.out_proj
        projections = []
        for w, b in zip((*weights, out.weight.detach()), (*biases, getattr(out, "bias", None))):
            linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None,
                                     device=w.device, dtype=w.dtype)
            with torch.no_grad():
                linear.weight.copy_(w)
                if b is not None:
                    linear.bias.copy_(b)
            projections.append(linear)
        return cls(*projections, attention.num_heads, dropout=attention.dropout,
                   batch_first=attention.batch_first).train(attention.training)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"SplitMultiheadAttention: query, key and value must all be 3-D "
                             f"(batched) or 2-D (unbatched), got {query.dim()}-D, "
                             f"{key.dim()}-D, {value.dim()}-D")
        if not batched:  # as a batch of one, batch first
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        n, length, _ = query.shape
        source = key.shape[1]
        if value.shape[:2] != key.shape[:2]:
            raise ValueError(f"SplitMultiheadAttention: key and value must agree in batch and "
                             f"sequence, got {tuple(key.shape)} and {tuple(value.shape)}")
        key_padding_mask = _float_mask(key_padding_mask, "key_padding_mask", query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("SplitMultiheadAttention: is_causal is a hint that attn_mask is "
                               "the causal mask, and needs that attn_mask (as "
                               "nn.MultiheadAttention does)")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # scaled_dot_product_attention builds the causal mask itself
        else:
            attn_mask = _float_mask(attn_mask, "attn_mask", query.dtype)
            is_causal = False
        h, d = self.num_heads, self.head_dim
        q = self.q_proj(query).view(n, length, h, d).transpose(1, 2)  # [N, H, L, D]
        k = self.k_proj(key).view(n, source, h, d).transpose(1, 2)
        v = self.v_proj(value).view(n, source, h, d).transpose(1, 2)
        if attn_mask is not None:
            shape = (length, source) if attn_mask.dim() == 2 else (n * h, length, source)
            if tuple(attn_mask.shape) != shape:
                raise ValueError(f"SplitMultiheadAttention: attn_mask must be {shape}, got "
                                 f"{tuple(attn_mask.shape)}")
            attn_mask = attn_mask.view(-1, h, length, source) if attn_mask.dim() == 3 \
                else attn_mask
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (n, source):
                raise ValueError(f"SplitMultiheadAttention: key_padding_mask must be "
                                 f"{(n, source)}, got {tuple(key_padding_mask.shape)}")
            padding = key_padding_mask.view(n, 1, 1, source)
            attn_mask = padding if attn_mask is None else attn_mask + padding
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q * math.sqrt(1.0 / d)) @ k.transpose(-2, -1)
            weights = torch.softmax(scores if attn_mask is None else scores + attn_mask, dim=-1)
            if dropout > 0:  # the weights returned are those v is weighted with, as torch's
                weights = F.dropout(weights, p=dropout)
            out = weights @ v
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                 dropout_p=dropout, is_causal=is_causal)
        out = self.out_proj(out.transpose(1, 2).reshape(n, length, self.embed_dim))
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"dropout={self.dropout}, batch_first={self.batch_first}")
