# vllm-project/vllm#40534 ("[Model] Gemma4: add bidirectional vision attention for sliding layers with
# window guard", merged; addresses issue vllm-project/vllm#40106). Written from the PR and issue text.
#
# Gemma 4 checkpoints whose text config says use_bidirectional_attention="vision" let the soft tokens of
# one image attend each other both ways on the sliding_attention layers (HF create_causal_mask_mapping:
# sliding-window causal OR blockwise-within-image; full_attention layers stay causal). Before the fix vLLM
# never filled mm_prefix_range for gemma4 (the model type was not in MM_PREFIX_LM_MODELS), so the unified
# attention kernel ran every layer plain causal over the image: image tokens only saw earlier patches, and
# the text after the image read those hidden states. Fix: register gemma4 in MM_PREFIX_LM_MODELS so the
# runner builds per-request mm_prefix_range for each image span (skipping spans longer than the window),
# and clear the range on full_attention layers in Gemma4ForConditionalGeneration.forward.
#
# Tiny CPU port: a GPUModelRunner-style metadata builder over a packed (varlen) batch of two requests,
# a torch stand-in for the Triton unified attention kernel (causal + sliding window + mm prefix ranges),
# and a two-layer Gemma-4-like text model (one sliding layer, one full layer).
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

if FIXED:
    MM_PREFIX_LM_MODELS = ("gemma3", "paligemma", "gemma4")
else:
    MM_PREFIX_LM_MODELS = ("gemma3", "paligemma")


@dataclass
class PlaceholderRange:
    offset: int
    length: int

    def extract_embeds_range(self):
        return [(self.offset, self.offset + self.length - 1)]


@dataclass
class MultiModalFeatureSpec:
    mm_position: PlaceholderRange


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list
    mm_features: list = field(default_factory=list)


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    # per request: list of (start, end) inclusive positions that attend bidirectionally
    mm_prefix_range: Optional[dict] = None


class GPUModelRunner:
    def __init__(self, model_config, sliding_window):
        self.model_config = model_config
        self.sliding_window = sliding_window
        self.is_mm_prefix_lm = model_config.hf_config.model_type in MM_PREFIX_LM_MODELS

    def _get_mm_prefix_ranges(self, reqs):
        if not self.is_mm_prefix_lm:
            return None
        ranges = {}
        for i, req in enumerate(reqs):
            for mm_feature in req.mm_features:
                for r in mm_feature.mm_position.extract_embeds_range():
                    if FIXED and self.sliding_window is not None and (r[1] - r[0] + 1) > self.sliding_window:
                        continue
                    ranges.setdefault(i, []).append(r)
        return ranges

    def _prepare_inputs(self, reqs):
        lens = [len(r.prompt_token_ids) for r in reqs]
        query_start_loc = torch.tensor([0] + lens).cumsum(0)
        input_ids = torch.tensor(sum((r.prompt_token_ids for r in reqs), []))
        positions = torch.cat([torch.arange(n) for n in lens])
        attn_metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(lens),
            mm_prefix_range=self._get_mm_prefix_ranges(reqs),
        )
        return input_ids, positions, attn_metadata


def unified_attention(q, k, v, attn_metadata, sliding_window, mm_prefix_range, scale):
    # torch stand-in for the Triton unified attention kernel: per request, causal (and windowed on local
    # layers), OR'ed with the bidirectional mm prefix ranges.
    out = torch.empty_like(q)
    qsl = attn_metadata.query_start_loc.tolist()
    for i in range(len(qsl) - 1):
        s, e = qsl[i], qsl[i + 1]
        n = e - s
        qi = torch.arange(n)[:, None]
        ki = torch.arange(n)[None, :]
        allowed = ki <= qi
        if sliding_window is not None:
            allowed = allowed & (qi - ki < sliding_window)
        if mm_prefix_range is not None:
            for (a, b) in mm_prefix_range.get(i, []):
                in_q = (qi >= a) & (qi <= b)
                in_k = (ki >= a) & (ki <= b)
                allowed = allowed | (in_q & in_k)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s:e])
    return out


class Attention(nn.Module):
    def __init__(self, num_heads, head_dim, scale, sliding_window):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.mm_prefix_range_cleared = False

    def forward(self, q, k, v, attn_metadata):
        mm_prefix_range = None if self.mm_prefix_range_cleared else attn_metadata.mm_prefix_range
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_heads, self.head_dim)
        v = v.view(-1, self.num_heads, self.head_dim)
        o = unified_attention(q, k, v, attn_metadata, self.sliding_window, mm_prefix_range, self.scale)
        return o.reshape(-1, self.num_heads * self.head_dim)


def rotate(x, positions, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        sw = config.sliding_window if self.layer_type == "sliding_attention" else None
        h, nh, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        self.nh, self.hd = nh, hd
        self.qkv_proj = nn.Linear(h, 3 * nh * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.attn = Attention(nh, hd, hd ** -0.5, sw)
        self.input_layernorm = nn.RMSNorm(h)
        self.post_attention_layernorm = nn.RMSNorm(h)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(approximate="tanh"), nn.Linear(4 * h, h))

    def forward(self, positions, hidden_states, attn_metadata):
        x = self.input_layernorm(hidden_states)
        q, k, v = self.qkv_proj(x).chunk(3, -1)
        q = rotate(q.view(-1, self.nh, self.hd), positions).reshape(q.shape)
        k = rotate(k.view(-1, self.nh, self.hd), positions).reshape(k.shape)
        hidden_states = hidden_states + self.o_proj(self.attn(q, k, v, attn_metadata))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Gemma4ForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        text_config = config.text_config
        self.config = config
        self.embed_tokens = nn.Embedding(text_config.vocab_size, text_config.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(text_config, i) for i in range(text_config.num_hidden_layers))
        self.norm = nn.RMSNorm(text_config.hidden_size)
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        self._full_attn_layer_idxs = frozenset()
        if FIXED and getattr(text_config, "use_bidirectional_attention", None) == "vision":
            self._full_attn_layer_idxs = frozenset(
                i for i, lt in enumerate(text_config.layer_types) if lt != "sliding_attention"
            )

    def _clear_mm_prefix_for_full_attn_layers(self):
        for i, layer in enumerate(self.layers):
            layer.attn.mm_prefix_range_cleared = i in self._full_attn_layer_idxs

    def forward(self, input_ids, positions, attn_metadata, image_embeds=None, image_token_id=None):
        hidden_states = self.embed_tokens(input_ids)
        if image_embeds is not None:
            hidden_states = hidden_states.clone()
            hidden_states[input_ids == image_token_id] = image_embeds
        if FIXED:
            self._clear_mm_prefix_for_full_attn_layers()
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, attn_metadata)
        return self.norm(hidden_states)

    def compute_logits(self, hidden_states):
        return self.lm_head(hidden_states)


def main():
    torch.manual_seed(0)
    text_config = SimpleNamespace(
        vocab_size=64, hidden_size=32, num_attention_heads=2, head_dim=16, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        use_bidirectional_attention="vision",
    )
    hf_config = SimpleNamespace(model_type="gemma4", text_config=text_config, image_token_id=63)
    model_config = SimpleNamespace(hf_config=hf_config)
    model = Gemma4ForConditionalGeneration(hf_config).eval()
    runner = GPUModelRunner(model_config, text_config.sliding_window)

    img = hf_config.image_token_id
    # request 0: <bos> text <image x5> text ; request 1: text only
    req0 = CachedRequestState("req-0", [2, 11, 12, img, img, img, img, img, 13, 14, 15],
                              [MultiModalFeatureSpec(PlaceholderRange(offset=3, length=5))])
    req1 = CachedRequestState("req-1", [2, 21, 22, 23, 24, 25, 26])
    reqs = [req0, req1]
    input_ids, positions, attn_metadata = runner._prepare_inputs(reqs)
    image_embeds = torch.randn(5, text_config.hidden_size)

    with torch.no_grad():
        hidden = model(input_ids, positions, attn_metadata, image_embeds, img)
        last = attn_metadata.query_start_loc[1:] - 1
        logits = model.compute_logits(hidden[last])
    next_tokens = logits.argmax(-1)
    print("mm_prefix_range:", attn_metadata.mm_prefix_range)
    for req, lg, tok in zip(reqs, logits, next_tokens):
        print(f"{req.req_id}: next token {tok.item()}, top logit {lg.max().item():.4f}")


if __name__ == "__main__":
    main()
