# Citation: prescient-design/lobster PR #149 ("cpu attn mask"), commit 152f709
#   (buggy parent 152f709^ = fd2fbe2-era code).
# Upstream: src/lobster/model/_ume.py  UME.embed  (calls FlexBERT.tokens_to_latents ->
#   modern_bert/_model.py FlexBertModel.forward -> FlexBertPaddedEncoder ->
#   FlexBertPaddedPreNormLayer -> FlexBertPaddedAttention (SDPA with use_sdpa_attn_mask)).
# Bug: UME (Universal Molecular Encoder: proteins / nucleotides / SMILES) pooled a padded
#   batch with `embeddings.mean(dim=1)`: the attention inside the encoder honours the
#   attention_mask, but the sequence embedding is averaged over every position including
#   <pad>, so a protein's embedding depends on the longest sequence in its batch (and
#   token-level outputs keep the padding rows).
# Fix: use the attention_mask for the pooling: sum(embeddings * mask) / clamp(mask.sum, 1);
#   token-level outputs are multiplied by the mask.
# CPU path (use_flash_attn=False -> padding="padded", use_sdpa_attn_mask=True), tiny sizes.
import sys
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class FlexBertConfig:
    def __init__(self, vocab_size, pad_token_id, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=64, padding="padded",
                 use_fa2=False, use_sdpa_attn_mask=True, embed_norm=True, final_norm=False,
                 attention_probs_dropout_prob=0.0, norm_eps=1e-5):
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.padding = padding
        self.use_fa2 = use_fa2
        self.use_sdpa_attn_mask = use_sdpa_attn_mask
        self.embed_norm = embed_norm
        self.final_norm = final_norm
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.norm_eps = norm_eps


class RMSNorm(nn.Module):
    """Llama2 RMSNorm implementation"""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def get_norm_layer(config):
    return RMSNorm(config.hidden_size, eps=config.norm_eps)


def posemb_sincos_1d(patches, temperature=10000, residue_index=None):
    n, dim, device, dtype = *patches.shape[-2:], patches.device, patches.dtype
    n = torch.arange(n, device=device) if residue_index is None else residue_index
    assert (dim % 2) == 0, "feature dimension must be multiple of 2 for sincos emb"
    omega = torch.arange(dim // 2, device=device) / (dim // 2 - 1)
    omega = 1.0 / (temperature**omega)
    n = n[..., None] * omega
    pe = torch.cat((n.sin(), n.cos()), dim=-1)
    return pe.type(dtype)


class FlexBertLinEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.norm = get_norm_layer(config) if config.embed_norm else nn.Identity()
        self.drop = nn.Identity()

    def forward(self, input_ids, position_ids=None):
        emb = self.drop(self.norm(self.tok_embeddings(input_ids)))
        emb = emb + posemb_sincos_1d(emb, temperature=10000, residue_index=position_ids)
        return emb


class FlexBertPaddedAttention(nn.Module):
    def __init__(self, config, layer_id=None):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attn_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attn_head_size
        self.p_dropout = config.attention_probs_dropout_prob
        self.Wqkv = nn.Linear(config.hidden_size, 3 * self.all_head_size, bias=False)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.out_drop = nn.Identity()
        self.use_fa2 = config.use_fa2
        self.use_sdpa_attn_mask = config.use_sdpa_attn_mask

    def forward(self, hidden_states, attn_mask=None):
        bs, seqlen, dim = hidden_states.shape
        qkv = self.Wqkv(hidden_states)
        qkv = qkv.view(bs, seqlen, 3, self.num_attention_heads, self.attn_head_size)
        q, k, v = qkv.transpose(3, 1).unbind(dim=2)
        attn = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.p_dropout,
            attn_mask=attn_mask[:, None, None, :seqlen].to(torch.bool).expand(bs, 1, seqlen, seqlen)
            if self.use_sdpa_attn_mask
            else None,
        ).transpose(1, 2)
        attn = attn.reshape(bs, seqlen, dim)
        return self.out_drop(self.Wo(attn))


class FlexBertMLP(nn.Module):
    def __init__(self, config, layer_id=None):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.act = nn.GELU()
        self.drop = nn.Identity()
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        return self.Wo(self.drop(self.act(self.Wi(hidden_states))))


class FlexBertPaddedPreNormLayer(nn.Module):
    def __init__(self, config, layer_id=None):
        super().__init__()
        self.attn_norm = get_norm_layer(config)
        self.attn = FlexBertPaddedAttention(config, layer_id=layer_id)
        self.mlp_norm = get_norm_layer(config)
        self.mlp = FlexBertMLP(config, layer_id=layer_id)

    def forward(self, hidden_states, attn_mask=None):
        attn_out = hidden_states + self.attn(self.attn_norm(hidden_states), attn_mask)
        return attn_out + self.mlp(self.mlp_norm(attn_out))


class FlexBertPaddedEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [FlexBertPaddedPreNormLayer(config, layer_id=i) for i in range(config.num_hidden_layers)]
        )

    def forward(self, hidden_states, attention_mask, **kwargs):
        for layer_module in self.layers:
            hidden_states = layer_module(hidden_states, attn_mask=attention_mask)
        return hidden_states


class FlexBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = FlexBertLinEmbeddings(config)
        self.encoder = FlexBertPaddedEncoder(config)
        self.final_norm = get_norm_layer(config) if config.final_norm else None

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, indices=None,
                cu_seqlens=None, max_seqlen=None, **kwargs):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None and cu_seqlens is not None:
            seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
            position_ids = torch.cat([torch.arange(seqlen, device=input_ids.device) for seqlen in seqlens])
        embeddings = self.embeddings(input_ids, position_ids)
        encoder_outputs = self.encoder(
            hidden_states=embeddings,
            attention_mask=attention_mask,
            indices=indices,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
        )
        if self.final_norm is not None:
            encoder_outputs = self.final_norm(encoder_outputs)
        return encoder_outputs


class FlexBERT(nn.Module):
    def __init__(self, vocab_size, pad_token_id, model_kwargs=None):
        super().__init__()
        model_kwargs = model_kwargs or {}
        self.config = FlexBertConfig(vocab_size=vocab_size, pad_token_id=pad_token_id, **model_kwargs)
        self.model = FlexBertModel(self.config)

    @property
    def device(self):
        return next(self.parameters()).device

    def tokens_to_latents(self, input_ids, attention_mask):
        if self.config.padding == "unpadded":
            if input_ids.dim() == 3:
                input_ids = input_ids.squeeze(1)
            if attention_mask.dim() == 3:
                attention_mask = attention_mask.squeeze(1)
            return self.model(input_ids=input_ids, attention_mask=attention_mask)
        else:
            if input_ids.dim() == 3:
                input_ids = input_ids.squeeze(1)
            if attention_mask.dim() == 3:
                attention_mask = attention_mask.squeeze(1)
            return self.model(input_ids=input_ids, attention_mask=attention_mask)


# --- tiny amino-acid tokenizer in the UME layout: <cls> residues <eos> <pad>... ---
SPECIALS = ["<cls>", "<pad>", "<eos>", "<unk>", "<mask>"]
AA = list("ACDEFGHIKLMNPQRSTVWY")
VOCAB = {t: i for i, t in enumerate(SPECIALS + AA)}
PAD_ID = VOCAB["<pad>"]


def tokenize(seqs, max_length):
    ids, masks = [], []
    for s in seqs:
        t = [VOCAB["<cls>"]] + [VOCAB[c] for c in s] + [VOCAB["<eos>"]]
        m = [1] * len(t)
        t = t + [PAD_ID] * (max_length - len(t))
        m = m + [0] * (max_length - len(m))
        ids.append(t)
        masks.append(m)
    return {"input_ids": torch.tensor(ids).unsqueeze(1), "attention_mask": torch.tensor(masks).unsqueeze(1)}


class UME(nn.Module):
    def __init__(self, use_flash_attn=False, model_kwargs=None):
        super().__init__()
        model_kwargs = model_kwargs or {}
        model_kwargs["use_fa2"] = use_flash_attn
        if use_flash_attn:
            model_kwargs["padding"] = "unpadded"
        else:
            model_kwargs["padding"] = "padded"
            model_kwargs["use_sdpa_attn_mask"] = True
        self.model = FlexBERT(vocab_size=len(VOCAB), pad_token_id=PAD_ID, model_kwargs=model_kwargs)
        self.frozen = False

    def freeze(self):
        for p in self.model.parameters():
            p.requires_grad = False
        self.model.eval()
        self.frozen = True

    def embed(self, inputs, aggregate=True):
        if not all(k in inputs for k in {"input_ids", "attention_mask"}):
            raise ValueError("Missing required keys in inputs: 'input_ids' or 'attention_mask'")
        x = {k: v.to(self.model.device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        for key in ["input_ids", "attention_mask"]:
            if x[key].dim() == 2:
                x[key] = x[key].unsqueeze(1)
        assert x["input_ids"].ndim == 3
        assert x["input_ids"].shape[1] == 1

        if self.frozen:
            with torch.no_grad():
                embeddings = self.model.tokens_to_latents(**x)
        else:
            embeddings = self.model.tokens_to_latents(x["input_ids"], x["attention_mask"])

        batch_size = x["input_ids"].size(0)
        seq_len = x["input_ids"].size(-1)

        if self.model.config.padding == "unpadded":
            embeddings = embeddings.view(batch_size, seq_len, -1)

        if not FIXED:
            if aggregate:
                # Use mean pooling over sequence length dimension
                embeddings = embeddings.mean(dim=1)
            return embeddings

        attention_mask = x["attention_mask"]
        if attention_mask.dim() == 3:
            attention_mask = attention_mask.squeeze(1)
        if attention_mask.shape[1] != embeddings.shape[1]:
            if attention_mask.shape[1] > embeddings.shape[1]:
                attention_mask = attention_mask[:, : embeddings.shape[1]]
            else:
                pad_length = embeddings.shape[1] - attention_mask.shape[1]
                padding = torch.zeros(attention_mask.shape[0], pad_length, dtype=attention_mask.dtype,
                                      device=attention_mask.device)
                attention_mask = torch.cat([attention_mask, padding], dim=1)
        mask = attention_mask.float().unsqueeze(-1)

        if aggregate:
            masked_embeddings = embeddings * mask
            sum_embeddings = masked_embeddings.sum(dim=1)
            token_counts = mask.sum(dim=1)
            token_counts = torch.clamp(token_counts, min=1.0)
            embeddings = sum_embeddings / token_counts
        else:
            embeddings = embeddings * mask
        return embeddings


def main():
    ume = UME(use_flash_attn=False)
    ume.freeze()

    proteins = [
        "MKTAYIAKQRQISFVKSHFSRQ",
        "GSHMSLFDFF",
        "MEEPQSDPSV",
        "ACDKLW",
    ]
    max_length = max(len(p) for p in proteins) + 2
    batch = tokenize(proteins, max_length)

    pooled = ume.embed(batch, aggregate=True)
    print("pooled embeddings shape:", tuple(pooled.shape))
    for p, e in zip(proteins, pooled):
        print(f"  {p:<24s} norm={e.norm().item():.4f} first4={[round(v, 4) for v in e[:4].tolist()]}")

    # the same short protein, embedded on its own (no padding)
    alone = ume.embed(tokenize([proteins[3]], len(proteins[3]) + 2), aggregate=True)[0]
    print("ACDKLW alone: norm=%.4f first4=%s" % (alone.norm().item(), [round(v, 4) for v in alone[:4].tolist()]))
    print("cosine(ACDKLW in batch, alone) = %.6f" % F.cosine_similarity(pooled[3], alone, dim=0).item())

    # a toy retrieval: nearest neighbour of each protein by cosine over the pooled vectors
    sims = F.cosine_similarity(pooled[:, None, :], pooled[None, :, :], dim=-1)
    sims.fill_diagonal_(-2.0)
    print("nearest neighbour index per protein:", sims.argmax(dim=1).tolist())

    tok = ume.embed(batch, aggregate=False)
    print("token-level sum over padded positions of ACDKLW: %.4f" % tok[3, len(proteins[3]) + 2:].abs().sum().item())


if __name__ == "__main__":
    main()
