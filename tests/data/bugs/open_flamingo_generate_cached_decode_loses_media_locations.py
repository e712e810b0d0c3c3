# mlfoundations/open_flamingo, fixed in commit 5c90779 ("OpenFlamingo v2": use_cached_media / condition_use_cached_media).
# Bug: during HF-style cached generation each step feeds only the new token, so media_locations = (input_ids == <image>)
# is all False, text_time becomes 0 and the cross-attention mask zeroes every generated token's attention to the image.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


class MaskedCrossAttention(nn.Module):
    def __init__(self, *, dim, dim_visual, dim_head=8, heads=4, only_attend_immediate_media=True):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        inner_dim = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim_visual, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)
        self.only_attend_immediate_media = only_attend_immediate_media

    def forward(self, x, media, media_locations=None, use_cached_media=False):
        if not use_cached_media:
            assert media_locations.shape[1] == x.shape[1]
        T_txt = x.shape[1]
        b, T_img, n = media.shape[:3]
        h = self.heads
        x = self.norm(x)
        q = self.to_q(x)
        media = media.reshape(b, T_img * n, -1)
        k, v = self.to_kv(media).chunk(2, dim=-1)
        q, k, v = [t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v)]
        q = q * self.scale
        sim = einsum("... i d, ... j d -> ... i j", q, k)

        if exists(media_locations):
            media_time = torch.arange(T_img, device=x.device) + 1
            if use_cached_media:
                # text time is set to the last cached media location
                text_time = torch.count_nonzero(media_locations, dim=1)[:, None].expand(-1, T_txt)
            else:
                # at each boolean of True, increment the time counter (relative to media time)
                text_time = media_locations.cumsum(dim=-1)
            mask_op = torch.eq if self.only_attend_immediate_media else torch.ge
            text_to_media_mask = mask_op(
                text_time[:, None, :, None],
                media_time.repeat_interleave(n)[None, None, None, :],
            )
            sim = sim.masked_fill(~text_to_media_mask, -torch.finfo(sim.dtype).max)

        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)

        if exists(media_locations) and self.only_attend_immediate_media:
            # any text without a preceding media needs to have attention zeroed out
            text_without_media_mask = text_time == 0
            attn = attn.masked_fill(text_without_media_mask[:, None, :, None], 0.0)

        out = einsum("... i j, ... j d -> ... i d", attn, v)
        out = out.transpose(1, 2).reshape(b, T_txt, -1)
        return self.to_out(out)


class GatedCrossAttentionBlock(nn.Module):
    def __init__(self, *, dim, dim_visual):
        super().__init__()
        self.attn = MaskedCrossAttention(dim=dim, dim_visual=dim_visual)
        self.attn_gate = nn.Parameter(torch.tensor([1.0]))  # trained gate (init 0.0 upstream)
        self.ff = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim, bias=False), nn.GELU(),
                                nn.Linear(2 * dim, dim, bias=False))
        self.ff_gate = nn.Parameter(torch.tensor([1.0]))

    def forward(self, x, media, media_locations=None, use_cached_media=False):
        x = self.attn(x, media, media_locations=media_locations, use_cached_media=use_cached_media) \
            * self.attn_gate.tanh() + x
        x = self.ff(x) * self.ff_gate.tanh() + x
        return x


class DecoderLayer(nn.Module):
    """A plain causal LM block with a HF-style (k, v) past_key_value."""

    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, past_key_value=None):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = [z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v)]
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        present = (k, v)
        S = k.shape[2]
        causal = torch.ones(t, S, dtype=torch.bool).tril(diagonal=S - t)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.ln2(x))
        return x, present


class FlamingoLayer(nn.Module):
    def __init__(self, gated_cross_attn_layer, decoder_layer):
        super().__init__()
        self.gated_cross_attn_layer = gated_cross_attn_layer
        self.decoder_layer = decoder_layer
        self.vis_x = None
        self.media_locations = None
        self.use_cached_media = False

    def is_conditioned(self):
        return self.vis_x is not None and self.media_locations is not None

    def condition_vis_x(self, vis_x):
        self.vis_x = vis_x

    def condition_media_locations(self, media_locations):
        self.media_locations = media_locations

    def condition_use_cached_media(self, use_cached_media):
        self.use_cached_media = use_cached_media

    def forward(self, lang_x, past_key_value=None):
        if self.gated_cross_attn_layer is not None:
            lang_x = self.gated_cross_attn_layer(
                lang_x, self.vis_x, media_locations=self.media_locations,
                use_cached_media=self.use_cached_media,
            )
        return self.decoder_layer(lang_x, past_key_value=past_key_value)


class FlamingoLM(nn.Module):
    """Language model with FlamingoLMMixin applied (cross_attn_every_n_layers=1)."""

    def __init__(self, vocab=32, dim=32, dim_visual=16, n_layers=2, media_token_id=1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [FlamingoLayer(GatedCrossAttentionBlock(dim=dim, dim_visual=dim_visual), DecoderLayer(dim))
             for _ in range(n_layers)]
        )
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.media_token_id = media_token_id
        self._use_cached_vision_x = False

    def is_conditioned(self):
        return all(l.is_conditioned() for l in self.layers)

    def forward(self, input_ids, past_key_values=None):
        """Condition the Flamingo layers on the media locations before forward()"""
        media_locations = input_ids == self.media_token_id
        if FIXED:
            # if there are media already cached and we're generating and there are no media tokens in the input,
            # we'll assume that ALL input tokens should attend to the last previous media that is cached.
            use_cached_media_locations = (
                self._use_cached_vision_x and self.is_conditioned() and not media_locations.any()
            )
            for layer in self.layers:
                if not use_cached_media_locations:
                    layer.condition_media_locations(media_locations)
                layer.condition_use_cached_media(use_cached_media_locations)
        else:
            for layer in self.layers:
                layer.condition_media_locations(media_locations)

        x = self.embed(input_ids)
        presents = []
        for i, layer in enumerate(self.layers):
            x, present = layer(x, past_key_value=None if past_key_values is None else past_key_values[i])
            presents.append(present)
        return self.lm_head(self.ln_f(x)), presents

    def clear_conditioned_layers(self):
        for layer in self.layers:
            layer.condition_vis_x(None)
            layer.condition_media_locations(None)
            layer.condition_use_cached_media(None)


def condition_vis_x(lm, vis_x):
    for layer in lm.layers:
        layer.condition_vis_x(vis_x)


lm = FlamingoLM().eval()
B, T_img, n_latents, dim_visual = 2, 1, 4, 16
vision_x = torch.randn(B, T_img, n_latents, dim_visual)  # output of the perceiver resampler
lang_x = torch.tensor([[1, 5, 9, 12, 7], [1, 3, 14, 6, 20]])  # "<image> prompt ..."

with torch.no_grad():
    # Flamingo.generate: encode vision once, then HF generate (greedy, use_cache=True)
    condition_vis_x(lm, vision_x)
    lm._use_cached_vision_x = True
    logits, past = lm(lang_x)
    seq = lang_x
    max_diff = 0.0
    for step in range(5):
        next_tok = logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, next_tok], dim=1)
        logits, past = lm(next_tok, past_key_values=past)
        # reference: same sequence, no KV cache (media_locations from the full sequence)
        lm.clear_conditioned_layers()
        condition_vis_x(lm, vision_x)
        lm._use_cached_vision_x = False
        ref_logits, _ = lm(seq)
        max_diff = max(max_diff, (logits[:, -1] - ref_logits[:, -1]).abs().max().item())
        # restore the generation conditioning (prompt media_locations kept by the layers)
        for layer in lm.layers:
            layer.condition_media_locations(seq == lm.media_token_id)
        lm._use_cached_vision_x = True
    lm.clear_conditioned_layers()

print(f"max |cached-decode logits - full-recompute logits| over 5 generated tokens: {max_diff:.3e}")
