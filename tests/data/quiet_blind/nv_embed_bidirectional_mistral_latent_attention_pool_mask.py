"""NV-Embed: a Mistral decoder with its causal mask removed, then latent-attention pooling over a pool_mask.

Follows nvidia/NV-Embed-v2 modeling_nvembed.py (recalled): BidirectionalMistralModel sets is_causal = False
on every self-attention and builds only a padding mask (_prepare_4d_attention_mask, not the causal one), because
an embedding model should let every token see the whole text.  LatentAttentionModel then lets every token
cross-attend to a learned latent array (512 latents upstream, 16 here) with mask=None, since the keys are
parameters, not tokens, and none of them is padding.  Mean pooling uses pool_mask = attention_mask with the
instruction prefix zeroed, so the instruction is read by attention but not averaged into the embedding.
Padding is on the right.  Checked: each text alone (no padding) gives the same embedding, and a token early in
the text changes when a later token changes (the model really is bidirectional).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import einsum


class MistralConfig:
    vocab_size = 80
    hidden_size = 32
    num_attention_heads = 4
    num_key_value_heads = 2
    num_hidden_layers = 2
    pad_token_id = 0


class MistralAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h, self.kv = config.num_attention_heads, config.num_key_value_heads
        self.hd = config.hidden_size // self.h
        self.q_proj = nn.Linear(config.hidden_size, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, config.hidden_size, bias=False)
        self.is_causal = True  # Mistral's default; NV-Embed turns it off

    def forward(self, x, attention_mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=True,
                                             is_causal=self.is_causal and attention_mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class BidirectionalMistralModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.pos = nn.Embedding(64, config.hidden_size)
        self.layers = nn.ModuleList(MistralAttention(config) for _ in range(config.num_hidden_layers))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(config.hidden_size, 64), nn.SiLU(), nn.Linear(64, config.hidden_size))
                                  for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size)
        for layer in self.layers:
            layer.is_causal = False

    @staticmethod
    def _prepare_4d_attention_mask(mask, dtype):
        """Padding only, expanded over queries: [bsz, 1, tgt, src] additive."""
        inverted = 1.0 - mask[:, None, None, :].to(dtype)
        return inverted.masked_fill(inverted.bool(), torch.finfo(dtype).min).expand(-1, 1, mask.size(1), -1)

    def forward(self, input_ids, attention_mask):
        h = self.embed_tokens(input_ids) + self.pos(torch.arange(input_ids.size(1)))
        mask4d = self._prepare_4d_attention_mask(attention_mask, h.dtype)
        for attn, mlp in zip(self.layers, self.mlps):
            h = h + attn(h, mask4d)
            h = h + mlp(h)
        return self.norm(h)


class PreNorm(nn.Module):
    def __init__(self, dim, fn, context_dim=None):
        super().__init__()
        self.fn, self.norm = fn, nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(context_dim) if context_dim is not None else None

    def forward(self, x, **kwargs):
        if self.norm_context is not None:
            kwargs["context"] = self.norm_context(kwargs["context"])
        return self.fn(self.norm(x), **kwargs)


class Attention(nn.Module):
    def __init__(self, query_dim, context_dim, heads=4, dim_head=8):
        super().__init__()
        inner = heads * dim_head
        self.scale, self.heads = dim_head ** -0.5, heads
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_kv = nn.Linear(context_dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, x, context, mask=None):
        h = self.heads
        q, (k, v) = self.to_q(x), self.to_kv(context).chunk(2, dim=-1)
        q, k, v = (t.unflatten(-1, (h, -1)).transpose(1, 2).flatten(0, 1) for t in (q, k, v))
        sim = einsum("b i d, b j d -> b i j", q, k) * self.scale
        if mask is not None:
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = einsum("b i j, b j d -> b i d", attn, v)
        return self.to_out(out.unflatten(0, (-1, h)).transpose(1, 2).flatten(2))


class LatentAttentionModel(nn.Module):
    def __init__(self, hidden_dim=32, latent_dim=32, num_latents=16):
        super().__init__()
        self.cross_attend_blocks = nn.ModuleList([
            PreNorm(latent_dim, Attention(latent_dim, hidden_dim), context_dim=hidden_dim),
            PreNorm(latent_dim, nn.Sequential(nn.Linear(latent_dim, 64), nn.GELU(), nn.Linear(64, latent_dim))),
        ])
        self.latents = nn.Parameter(torch.randn(num_latents, latent_dim))

    def forward(self, hiddens, attention_mask=None):
        cross_attn, cross_ff = self.cross_attend_blocks
        x = self.latents.expand(hiddens.size(0), -1, -1)
        # tokens are the queries, latents the keys: no token is a key, so no padding mask here
        hiddens = cross_attn(hiddens, context=x, mask=None) + hiddens
        hiddens = cross_ff(hiddens) + hiddens
        s = torch.sum(hiddens * attention_mask.unsqueeze(-1).float(), dim=1)
        d = attention_mask.sum(dim=1, keepdim=True).float()
        return s / d


class NVEmbedModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding_model = BidirectionalMistralModel(config)
        self.latent_attention_model = LatentAttentionModel(config.hidden_size)

    def forward(self, input_ids, attention_mask, pool_mask):
        last_hidden_state = self.embedding_model(input_ids, attention_mask)
        return F.normalize(self.latent_attention_model(last_hidden_state, pool_mask), p=2, dim=-1)


def collate(texts, instruction_lens, pad_id):
    """Right padding; pool_mask hides the instruction prefix from pooling only."""
    width = max(len(t) for t in texts)
    input_ids = torch.stack([F.pad(t, (0, width - len(t)), value=pad_id) for t in texts])
    attention_mask = (torch.arange(width)[None] < torch.tensor([len(t) for t in texts])[:, None]).long()
    pool_mask = attention_mask.clone()
    for i, n in enumerate(instruction_lens):
        pool_mask[i, :n] = 0
    return input_ids, attention_mask, pool_mask


def main():
    torch.manual_seed(0)
    config = MistralConfig()
    model = NVEmbedModel(config).eval()
    instruction = torch.randint(1, config.vocab_size, (4,))  # "Instruct: ... Query: " stand-in
    bodies = [torch.randint(1, config.vocab_size, (n,)) for n in (7, 3, 5)]
    texts = [torch.cat([instruction, b]) for b in bodies[:2]] + [bodies[2]]  # the passage has no instruction
    instruction_lens = [4, 4, 0]
    with torch.no_grad():
        embeds = model(*collate(texts, instruction_lens, config.pad_token_id))
        for i, t in enumerate(texts):
            alone = model(*collate([t], [instruction_lens[i]], config.pad_token_id))
            torch.testing.assert_close(embeds[i], alone[0], rtol=1e-5, atol=1e-5)
        # bidirectional: the first token's hidden state depends on the last token
        t = texts[0].clone()[None]
        ones = torch.ones_like(t)
        h1 = model.embedding_model(t, ones)[0, 0]
        t[0, -1] = 1 if t[0, -1] != 1 else 2
        h2 = model.embedding_model(t, ones)[0, 0]
        assert not torch.allclose(h1, h2)
    print("similarity q0.p", round((embeds[0] @ embeds[2]).item(), 4), "q1.p", round((embeds[1] @ embeds[2]).item(), 4))


if __name__ == "__main__":
    main()
