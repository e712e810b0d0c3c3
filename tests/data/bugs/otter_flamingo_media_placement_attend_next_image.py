"""Otter (OpenFlamingo-based) gated cross-attention: caption tokens attend the *next* image.

Citation: EvolvingLMMs-Lab/Otter#41 ("fix attention": "force only attend previous <image> token", merged
2023-04-27), commit dd8fcb7 ("fix attention: allow only_attend_previous=True while training on
multi_instruct") in collie_core/src/collie_lm.py and helpers.py.

Bug: ``FlamingoLMMixin.forward`` chose ``attend_previous = (random.random() < 0.5) if
self.use_media_placement_augmentation else False``.  With the augmentation off, ``attend_previous`` was
always False, and ``MaskedCrossAttention`` then shifts every text token's media time forward by one
(``text_time[~media_locations] += 1``) so that text attends the image *following* it (and text after the
last image attends nothing).  Otter's instruction data is laid out ``<image>caption<|endofchunk|>``: every
caption was trained looking at the next example's image instead of its own.

Fix (dd8fcb7): a new ``only_attend_previous=True`` argument threaded through Flamingo, init_flamingo and
the cross-attention blocks; ``attend_previous = self.attend_previous`` (True) is conditioned on the layers
("IMPORTANT: Force `attend_previous` to True when we place training data as <image>caption<|endofchunk|>").

This program keeps the FlamingoLayer / FlamingoLMMixin conditioning and MaskedCrossAttention as written
there (einops replaced by plain torch ops); the cross-attention is a hand-written softmax over
``q @ k^T`` with the text-to-media mask filled in.  Two interleaved examples ``<image> a b <eoc> <image>
c d <eoc>``; the tanh gates are set to a trained value (they are initialised at 0).
"""
import random
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv

MEDIA_TOKEN_ID = 3
EOC_TOKEN_ID = 2


def exists(val):
    return val is not None


class FeedForward(nn.Sequential):
    def __init__(self, dim, mult=4):
        super().__init__(nn.LayerNorm(dim), nn.Linear(dim, dim * mult, bias=False), nn.GELU(),
                         nn.Linear(dim * mult, dim, bias=False))


class MaskedCrossAttention(nn.Module):
    def __init__(self, *, dim, dim_visual, dim_head=8, heads=4, only_attend_immediate_media=True,
                 only_attend_previous=True):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        inner_dim = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim_visual, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)
        # whether for text to only attend to immediate preceding image, or all previous images
        self.only_attend_immediate_media = only_attend_immediate_media
        self.only_attend_previous = only_attend_previous

    def forward(self, x, media, media_locations=None, attend_previous=True):
        """attend_previous: if false, ignores immediately preceding image and starts attending when following image"""
        b, T_img, n = media.shape[:3]
        h = self.heads
        x = self.norm(x)
        q = self.to_q(x)
        media = media.reshape(b, T_img * n, media.shape[-1])  # b t n d -> b (t n) d
        k, v = self.to_kv(media).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))  # b n (h d) -> b h n d
        q = q * self.scale
        sim = torch.einsum("... i d, ... j d -> ... i j", q, k)

        if exists(media_locations):
            # at each boolean of True, increment the time counter (relative to media time)
            text_time = media_locations.cumsum(dim=-1)
            media_time = torch.arange(T_img, device=x.device) + 1
            if not attend_previous:
                text_time[~media_locations] += 1
                # make sure max is still the number of images in the sequence
                text_time[text_time > torch.count_nonzero(media_locations, dim=1)[:, None]
                          .expand(-1, text_time.shape[1])] = 0
            # text time must equal media time if only attending to most immediate image
            # otherwise, as long as text time is greater than media time (if attending to all previous images / media)
            mask_op = torch.eq if self.only_attend_immediate_media else torch.ge
            text_to_media_mask = mask_op(
                text_time[:, None, :, None],  # b i -> b 1 i 1
                media_time.repeat_interleave(n)[None, None, None, :],  # j -> 1 1 1 (j n)
            )
            sim = sim.masked_fill(~text_to_media_mask, -torch.finfo(sim.dtype).max)

        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        if exists(media_locations) and self.only_attend_immediate_media:
            # any text without a preceding media needs to have attention zeroed out
            text_without_media_mask = text_time == 0
            attn = attn.masked_fill(text_without_media_mask[:, None, :, None], 0.0)
        out = torch.einsum("... i j, ... j d -> ... i d", attn, v)
        out = out.transpose(1, 2).reshape(b, out.shape[2], -1)  # b h n d -> b n (h d)
        return self.to_out(out)


class GatedCrossAttentionBlock(nn.Module):
    def __init__(self, *, dim, dim_visual, dim_head=8, heads=4, ff_mult=4, only_attend_immediate_media=True,
                 only_attend_previous=True):
        super().__init__()
        self.attn = MaskedCrossAttention(dim=dim, dim_visual=dim_visual, dim_head=dim_head, heads=heads,
                                         only_attend_immediate_media=only_attend_immediate_media,
                                         only_attend_previous=only_attend_previous)
        self.attn_gate = nn.Parameter(torch.tensor([0.0]))
        self.ff = FeedForward(dim, mult=ff_mult)
        self.ff_gate = nn.Parameter(torch.tensor([0.0]))

    def forward(self, x, media, media_locations=None, attend_previous=True):
        x = self.attn(x, media, media_locations=media_locations, attend_previous=attend_previous) \
            * self.attn_gate.tanh() + x
        return self.ff(x) * self.ff_gate.tanh() + x


class FlamingoLayer(nn.Module):
    def __init__(self, gated_cross_attn_layer, decoder_layer):
        super().__init__()
        self.gated_cross_attn_layer = gated_cross_attn_layer
        self.decoder_layer = decoder_layer
        self.vis_x = None
        self.media_locations = None

    def condition_vis_x(self, vis_x):
        self.vis_x = vis_x

    def condition_media_locations(self, media_locations):
        self.media_locations = media_locations

    def condition_attend_previous(self, attend_previous):
        self.attend_previous = attend_previous

    def forward(self, lang_x, attention_mask=None, **decoder_layer_kwargs):
        if self.gated_cross_attn_layer is None:
            return self.decoder_layer(lang_x, src_mask=attention_mask)
        if self.vis_x is None:
            raise ValueError("vis_x must be conditioned before forward pass")
        if self.media_locations is None:
            raise ValueError("media_locations must be conditioned before forward pass")
        lang_x = self.gated_cross_attn_layer(lang_x, self.vis_x, media_locations=self.media_locations,
                                             attend_previous=self.attend_previous)
        return self.decoder_layer(lang_x, src_mask=attention_mask, is_causal=True)


class TinyCausalLM(nn.Module):
    """Stands in for the Llama / MPT language encoder the factory loads."""

    def __init__(self, vocab=32, dim=32, n_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True) for _ in range(n_layers)])
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def get_decoder(self):
        return self

    def forward(self, input_ids, attention_mask=None):
        h = self.embed_tokens(input_ids)
        L = input_ids.shape[1]
        causal = torch.triu(torch.full((L, L), float("-inf")), diagonal=1)
        for layer in self.layers:
            h = layer(h, attention_mask=causal)
        return self.lm_head(h)


class FlamingoLM(TinyCausalLM):
    """TinyCausalLM extended with FlamingoLMMixin (extend_instance in the factory)."""

    def init_flamingo(self, media_token_id, vis_hidden_size, cross_attn_every_n_layers,
                      use_media_placement_augmentation, only_attend_previous=True):
        dim = self.embed_tokens.embedding_dim
        self.gated_cross_attn_layers = nn.ModuleList([
            GatedCrossAttentionBlock(dim=dim, dim_visual=vis_hidden_size, only_attend_previous=only_attend_previous)
            if (layer_idx + 1) % cross_attn_every_n_layers == 0 else None
            for layer_idx, _ in enumerate(self.layers)
        ])
        self.layers = nn.ModuleList([FlamingoLayer(g, d) for g, d in zip(self.gated_cross_attn_layers, self.layers)])
        self.media_token_id = media_token_id
        self.use_media_placement_augmentation = use_media_placement_augmentation
        self.attend_previous = only_attend_previous
        self.initialized_flamingo = True

    def forward(self, input_ids, attention_mask=None):
        """Condition the Flamingo layers on the media locations before forward()"""
        media_locations = input_ids == self.media_token_id
        if FIXED:
            # IMPORTANT: Force `attend_previous` to True when we place training data as <image>caption<|endofchunk|>
            attend_previous = self.attend_previous
        else:
            attend_previous = (random.random() < 0.5) if self.use_media_placement_augmentation else False
        for layer in self.get_decoder().layers:
            layer.condition_media_locations(media_locations)
            layer.condition_attend_previous(attend_previous)
        return super().forward(input_ids, attention_mask=attention_mask)


class Flamingo(nn.Module):
    def __init__(self, lang_encoder, eoc_token_id, media_token_id, vis_dim, cross_attn_every_n_layers=1,
                 use_media_placement_augmentation=False, only_attend_previous=True):
        super().__init__()
        self.eoc_token_id = eoc_token_id
        self.media_token_id = media_token_id
        self.vis_dim = vis_dim
        self.lang_encoder = lang_encoder
        self.lang_encoder.init_flamingo(media_token_id=media_token_id, vis_hidden_size=vis_dim,
                                        cross_attn_every_n_layers=cross_attn_every_n_layers,
                                        use_media_placement_augmentation=use_media_placement_augmentation,
                                        only_attend_previous=only_attend_previous)

    def forward(self, vision_x, lang_x, attention_mask=None):
        # vision_x: (B, T_img, n latents, vis_dim), the perceiver's output
        for layer in self.lang_encoder.layers:
            layer.condition_vis_x(vision_x)
        return self.lang_encoder(lang_x, attention_mask=attention_mask)


def main():
    torch.manual_seed(0)
    model = Flamingo(FlamingoLM(), eoc_token_id=EOC_TOKEN_ID, media_token_id=MEDIA_TOKEN_ID, vis_dim=16,
                     cross_attn_every_n_layers=1, use_media_placement_augmentation=False).eval()
    with torch.no_grad():
        for g in model.lang_encoder.gated_cross_attn_layers:
            g.attn_gate.fill_(1.0)  # a trained checkpoint's gates, not the zero init
    # <image> a b <|endofchunk|> <image> c d <|endofchunk|>
    lang_x = torch.tensor([[MEDIA_TOKEN_ID, 10, 11, EOC_TOKEN_ID, MEDIA_TOKEN_ID, 12, 13, EOC_TOKEN_ID]])
    vision_x = torch.randn(1, 2, 3, 16)
    with torch.no_grad():
        logits = model(vision_x, lang_x)
    print(f"{'fixed' if FIXED else 'buggy'} logits sum {logits.sum().item():.4f}")


if __name__ == "__main__":
    main()
