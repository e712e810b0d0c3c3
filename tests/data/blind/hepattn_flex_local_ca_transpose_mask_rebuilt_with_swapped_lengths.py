# hepattn (samvanstroud/hepattn commit ddea067, "fix flex attn mask transpose implementation", in PR #146
# "Pippa/flex local strided attn", squash-merged as e0d9d44): with local_strided_attn and attn_type="flex" the
# MaskFormerDecoder made the BlockMask for the reverse cross-attention (hits reading the object queries) by calling
# flex_local_ca_mask(kv_len, q_len), a fresh strided window over the queries (stride q_len / kv_len), where the dense
# "torch" path uses attn_mask.transpose(-2, -1) of the query -> hit window. The fix builds it with transpose_blockmask,
# which calls the forward mask_mod with q_idx and kv_idx swapped.
# Ported from src/hepattn/models/decoder.py, models/attention.py, flex/local_ca.py, models/encoder.py (Residual),
# models/dense.py at ddea067^ (torch.compile wrappers dropped: FlexAttention runs eagerly on CPU). One event of
# tracker hits (batch size 1, as the decoder asserts for local strided attention), no tasks.
import sys
import warnings
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, _mask_mod_signature, create_block_mask, flex_attention
from torch.nn.functional import scaled_dot_product_attention

FIXED = "--fixed" in sys.argv
warnings.filterwarnings("ignore")


# ---- hepattn/flex/local_ca.py -------------------------------------------------------------------------------------
def sliding_window_mask_strided(window_size: int, stride: float, q_len: int, kv_len: int, dev) -> _mask_mod_signature:
    if window_size % 2 != 0:
        raise ValueError("Window size must be even for strided sliding window")

    stride_val = torch.tensor(stride, device=dev)

    def mask_mod(b, h, q_idx, kv_idx):
        # b = 0, h = 0 here
        q_center = torch.round(q_idx * stride_val)
        return (kv_idx - q_center).abs() <= window_size // 2

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=dev)


def sliding_window_mask_strided_wrapped(window_size: int, stride: float, q_len: int, kv_len: int, dev) -> _mask_mod_signature:
    if window_size % 2 != 0:
        raise ValueError("Window size must be even for strided sliding window")

    stride_val = torch.tensor(stride, device=dev)
    kv_len_t = torch.as_tensor(kv_len, device=dev).reshape(())

    def mask_mod(b, h, q_idx, kv_idx):
        # b = 0, h = 0 here
        q_center = torch.round(q_idx * stride_val)

        diagonal = (kv_idx - q_center).abs() <= window_size // 2
        wrap_left = (kv_idx - q_center + kv_len_t).abs() <= window_size // 2
        wrap_right = (kv_idx - q_center - kv_len_t).abs() <= window_size // 2

        return diagonal | wrap_left | wrap_right

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=dev)


def transpose_blockmask(bm: BlockMask, *, q_tokens: int, kv_tokens: int, device=None) -> BlockMask:
    """Exact transpose of a FlexAttention BlockMask by transposing the mask function."""
    orig_mod = bm.mask_mod
    dev = device if device is not None else getattr(bm, "device", "cpu")

    # New queries are old keys; new keys are old queries.
    def mask_mod_T(b, h, q_idx, kv_idx):
        # Call the original predicate with swapped indices.
        return orig_mod(b, h, kv_idx, q_idx)

    return create_block_mask(
        mask_mod_T,
        B=None, H=None,
        Q_LEN=kv_tokens,   # new queries = old KV tokens
        KV_LEN=q_tokens,   # new keys    = old Q tokens
        device=dev,
    )


# ---- hepattn/models/attention.py (torch + flex backends) ----------------------------------------------------------
ATTN_TYPES = {"torch": scaled_dot_product_attention, "flex": flex_attention}
VARLEN_ATTN_TYPES = ["torch", "flash-varlen"]
ATTN_MASK_ATTN_TYPES = ["torch", "flex"]


def merge_masks(q_mask, kv_mask, attn_mask, q_shape, k_shape, device):
    merged_mask = None
    if q_mask is not None or kv_mask is not None:
        if q_mask is None:
            q_mask = torch.full(q_shape[:-1], True, device=device)
        if kv_mask is None:
            kv_mask = torch.full(k_shape[:-1], True, device=device)
        merged_mask = q_mask.unsqueeze(-1) & kv_mask.unsqueeze(-2)
    if attn_mask is not None:
        merged_mask = attn_mask & merged_mask if merged_mask is not None else attn_mask
    return merged_mask


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 8, bias: bool = True, attn_type: str = "torch", qkv_norm: bool = False) -> None:
        super().__init__()
        assert dim % num_heads == 0, "num_heads must divide dim."
        self.dim = dim
        self.bias = bias
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_type = attn_type
        self.qkv_norm = qkv_norm

        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim)) if bias else None
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        self.reset_parameters()
        self.set_backend(attn_type)

    def reset_parameters(self):
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.bias:
            nn.init.constant_(self.in_proj_bias, 0.0)
        self.out_proj.reset_parameters()

    def set_backend(self, attn_type: str) -> str:
        self.attn_type = attn_type
        self.attn = ATTN_TYPES[attn_type]
        return self.attn_type

    def separate_heads(self, x: Tensor, num_heads: int) -> Tensor:
        x = x.unflatten(-1, (num_heads, -1))  # B S D -> B S H Dh
        return x.transpose(-3, -2)  # B S H Dh -> B H S Dh

    def recombine_heads(self, x: Tensor) -> Tensor:
        x = x.transpose(-3, -2)  # B H S Dh -> B S H Dh
        return x.flatten(-2)  # B S H Dh -> B S D

    def _prepare_qkv(self, q: Tensor, kv: Tensor | None = None):
        if kv is None:
            kv = q
        q, k, v = F._in_projection_packed(q, kv, kv, self.in_proj_weight, self.in_proj_bias)  # noqa: SLF001
        q = self.separate_heads(q, self.num_heads)
        k = self.separate_heads(k, self.num_heads)
        v = self.separate_heads(v, self.num_heads)
        return q, k, v

    def forward(self, q: Tensor, kv: Tensor | None = None, q_mask=None, kv_mask=None, attn_mask=None, **kwargs) -> Tensor:
        if kv is None:
            q_shape = kv_shape = q.shape
        else:
            q_shape = q.shape
            kv_shape = kv.shape

        if kv_mask is not None:
            assert self.attn_type in VARLEN_ATTN_TYPES, f"Only the backends {VARLEN_ATTN_TYPES} support kv masking"
        if attn_mask is not None:
            assert self.attn_type in ATTN_MASK_ATTN_TYPES, f"Only the backends {ATTN_MASK_ATTN_TYPES} support attention masking"

        q, k, v = self._prepare_qkv(q, kv)

        if self.attn_type == "flex":
            out = self.attn(q, k, v, block_mask=attn_mask)
        elif self.attn_type == "torch":
            assert not isinstance(attn_mask, BlockMask)
            attn_mask = merge_masks(q_mask, kv_mask, attn_mask, q_shape, kv_shape, q.device)
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(-3)
            out = self.attn(q, k, v, attn_mask=attn_mask)
        else:
            raise ValueError(f"Invalid attention type: {self.attn_type}")

        out = self.recombine_heads(out)
        return self.out_proj(out)


# ---- hepattn/models/activation.py, dense.py, encoder.py (Residual) -------------------------------------------------
class SwiGLU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return x1 * F.silu(x2)


class Dense(nn.Module):
    def __init__(self, input_size: int, output_size: int | None = None, hidden_dim_scale: int = 2, bias: bool = True) -> None:
        super().__init__()
        output_size = output_size or input_size
        hidden = input_size * hidden_dim_scale
        self.net = nn.Sequential(nn.Linear(input_size, hidden * 2, bias=bias), SwiGLU(), nn.Linear(hidden, output_size, bias=bias))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Residual(nn.Module):
    def __init__(self, fn: nn.Module, dim: int, norm: str | None, post_norm: bool = False) -> None:
        super().__init__()
        self.fn = fn
        self.post_norm = post_norm
        self.norm = getattr(nn, norm)(dim, elementwise_affine=False) if isinstance(norm, str) else nn.Identity()

    def forward(self, x: Tensor, **kwargs) -> Tensor:
        if self.post_norm:
            x = self.norm(x)
            return x + self.fn(x, **kwargs)
        return x + self.fn(self.norm(x), **kwargs)


def unmerge_inputs(x: dict[str, Tensor], input_names: list[str]) -> dict[str, Tensor]:
    batch_size = x["key_embed"].shape[0]
    dim = x["key_embed"].shape[-1]
    for input_name in input_names:
        x[f"{input_name}_embed"] = x["key_embed"][x[f"key_is_{input_name}"]].view(batch_size, -1, dim)
    return x


# ---- hepattn/models/decoder.py ------------------------------------------------------------------------------------
class MaskFormerDecoder(nn.Module):
    def __init__(
        self,
        num_queries: int,
        decoder_layer_config: dict,
        num_decoder_layers: int,
        mask_attention: bool = True,
        local_strided_attn: bool = False,
        window_size: int = 512,
        window_wrap: bool = True,
    ):
        super().__init__()
        self.decoder_layers = nn.ModuleList([MaskFormerDecoderLayer(depth=i, **decoder_layer_config) for i in range(num_decoder_layers)])
        self.dim = decoder_layer_config["dim"]
        self.tasks: list | None = None  # Will be set by MaskFormer
        self.num_queries = num_queries
        self.mask_attention = mask_attention
        self.local_strided_attn = local_strided_attn
        self.attn_type = decoder_layer_config.get("attn_kwargs", {}).get("attn_type", "torch")
        self.window_size = window_size
        self.window_wrap = window_wrap
        self.initial_queries = nn.Parameter(torch.randn(self.num_queries, decoder_layer_config["dim"]))
        assert not (self.local_strided_attn and self.mask_attention), "local_strided_attn and mask_attention cannot both be True"

    def forward(self, x: dict[str, Tensor], input_names: list[str]):
        batch_size = x["key_embed"].shape[0]

        x["query_embed"] = self.initial_queries.expand(batch_size, -1, -1)
        x["query_valid"] = torch.full((batch_size, self.num_queries), True, device=x["query_embed"].device)

        attn_mask = None
        attn_mask_transpose = None
        if self.local_strided_attn:
            assert x["query_embed"].shape[0] == 1, "Local strided attention only supports batch size 1"
            if self.attn_type == "flex":
                device = x["query_embed"].device
                q_len = x["query_embed"].shape[1]
                kv_len = x["key_embed"].shape[1]
                attn_mask = self.flex_local_ca_mask(q_len, kv_len, device)
                if FIXED:
                    attn_mask_transpose = transpose_blockmask(attn_mask, q_tokens=q_len, kv_tokens=kv_len, device=device)
                else:
                    attn_mask_transpose = self.flex_local_ca_mask(kv_len, q_len, device)

        outputs: dict[str, dict] = {}
        for layer_index, decoder_layer in enumerate(self.decoder_layers):
            outputs[f"layer_{layer_index}"] = {}
            assert self.tasks is not None  # no task here has an intermediate loss, so none adds a mask

            x["query_embed"], x["key_embed"] = decoder_layer(
                x["query_embed"],
                x["key_embed"],
                attn_mask=attn_mask,
                q_mask=x.get("query_mask"),
                kv_mask=x.get("key_valid"),
                attn_mask_transpose=attn_mask_transpose,
            )
            x = unmerge_inputs(x, input_names)

        return x, outputs

    def flex_local_ca_mask(self, q_len: int, kv_len: int, device):
        # Calculate stride based on the ratio of key length to query length
        stride = kv_len / q_len
        window_mask_func = sliding_window_mask_strided_wrapped if self.window_wrap else sliding_window_mask_strided
        return window_mask_func(self.window_size, stride=stride, q_len=q_len, kv_len=kv_len, dev=device)


class MaskFormerDecoderLayer(nn.Module):
    def __init__(self, dim: int, norm: str = "LayerNorm", depth: int = 0, attn_kwargs: dict | None = None,
                 bidirectional_ca: bool = True) -> None:
        super().__init__()
        self.dim = dim
        self.bidirectional_ca = bidirectional_ca
        self.attn_kwargs = attn_kwargs or {}

        residual = partial(Residual, dim=dim, norm=norm)
        self.q_ca = residual(Attention(dim, **self.attn_kwargs))
        self.q_sa = residual(Attention(dim, **self.attn_kwargs))
        self.q_dense = residual(Dense(dim), norm=norm, post_norm=True)
        if self.bidirectional_ca:
            self.kv_ca = residual(Attention(dim, **self.attn_kwargs))
            self.kv_dense = residual(Dense(dim), norm=norm, post_norm=True)

    def forward(self, q, kv, attn_mask=None, q_mask=None, kv_mask=None, attn_mask_transpose=None):
        # Update query/object embeddings with the key/constituent embeddings
        q = self.q_ca(q, kv=kv, attn_mask=attn_mask, q_mask=q_mask, kv_mask=kv_mask)
        q = self.q_sa(q, q_mask=q_mask)
        q = self.q_dense(q)

        # Update key/constituent embeddings with the query/object embeddings
        if self.bidirectional_ca:
            if attn_mask is not None:
                if self.attn_kwargs.get("attn_type", "torch") == "flex":
                    assert attn_mask_transpose is not None, "attn_mask_transpose must be provided for flex attention"
                attn_mask = attn_mask_transpose if attn_mask_transpose is not None else attn_mask.transpose(-2, -1)

            kv = self.kv_ca(kv, kv=q, attn_mask=attn_mask, q_mask=kv_mask, kv_mask=q_mask)
            kv = self.kv_dense(kv)

        return q, kv


# ---- one event: 128 tracker hits sorted in phi, 32 object queries ---------------------------------------------------
def main():
    torch.manual_seed(0)
    dim, num_queries, num_hits = 32, 32, 128
    decoder = MaskFormerDecoder(
        num_queries=num_queries,
        decoder_layer_config={"dim": dim, "attn_kwargs": {"attn_type": "flex", "num_heads": 4}},
        num_decoder_layers=2,
        mask_attention=False,
        local_strided_attn=True,
        window_size=8,
        window_wrap=True,
    ).eval()
    decoder.tasks = []

    hit_phi = torch.sort(torch.rand(1, num_hits) * 2 * torch.pi - torch.pi, dim=-1).values
    hit_feats = torch.stack([torch.cos(hit_phi), torch.sin(hit_phi)], dim=-1)
    hit_embed = nn.Linear(2, dim)(hit_feats) + 0.1 * torch.randn(1, num_hits, dim)

    x = {"key_embed": hit_embed, "key_is_hit": torch.ones(1, num_hits, dtype=torch.bool)}
    with torch.no_grad():
        x, _ = decoder(x, input_names=["hit"])

    hits, queries = x["hit_embed"][0], x["query_embed"][0]
    print("hit embed[:4, :4]:\n", hits[:4, :4])
    print("query embed[:4, :4]:\n", queries[:4, :4])
    print("hit embed norm: %.6f  query embed norm: %.6f" % (hits.norm().item(), queries.norm().item()))


if __name__ == "__main__":
    main()
