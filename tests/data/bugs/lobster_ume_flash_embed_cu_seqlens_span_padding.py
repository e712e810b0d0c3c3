# Citation: prescient-design/lobster PR #105 ("more fa tests"), commit 72a229e
#   (buggy parent 72a229e^). Not the same bug as fd2fbe2 (#112), which fixed the non-flash
#   unpadded path that #105 introduced; this one is the flash-attention path #105 fixed.
# Upstream: src/lobster/model/modern_bert/_modern_bert.py  FlexBERT._prepare_inputs /
#   FlexBERT.tokens_to_latents, called by src/lobster/model/_ume.py  Ume.embed; then
#   modern_bert/_model.py FlexBertModel.forward -> _layers.py FlexBertUnpadEncoder.forward ->
#   FlexBertUnpadPreNormLayer -> _attention.py FlexBertUnpadAttention (flash_attn_varlen_qkvpacked_func).
# Bug: to embed a padded batch of proteins, tokens_to_latents flattened it with
#   _prepare_inputs, whose cu_seqlens is [0, L, 2L, ...] (every row counted at the padded
#   length L): the varlen flash-attention segments therefore include each row's <pad>
#   tokens, so real residues attend to padding and the embedding depends on the batch.
# Fix: tokens_to_latents passes the 2-D input_ids / attention_mask without cu_seqlens; the
#   unpadded encoder calls unpad_input(hidden_states, attention_mask) and derives cu_seqlens
#   from the real lengths (pad_input puts the rows back afterwards).
# flash_attn_varlen_qkvpacked_func is replaced by a plain-torch stand-in with the same
#   signature and semantics (non-causal, one softmax per [cu_seqlens[i], cu_seqlens[i+1]) segment).
import sys
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), deterministic=False):
    """Plain-torch stand-in: qkv (total, 3, nheads, headdim) -> (total, nheads, headdim)."""
    total, _, nheads, headdim = qkv.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(headdim)
    out = torch.empty(total, nheads, headdim, dtype=qkv.dtype, device=qkv.device)
    for i in range(cu_seqlens.numel() - 1):
        s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        q, k, v = qkv[s:e].float().unbind(dim=1)  # (n, h, d)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if causal:
            n = e - s
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        probs = scores.softmax(dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(qkv.dtype)
    return out


def index_first_axis(x, indices):
    return x[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    output = torch.zeros(first_axis_dim, *values.shape[1:], device=values.device, dtype=values.dtype)
    output[indices] = values
    return output


def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    hidden_states = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return hidden_states, indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.view(batch, seqlen, *output.shape[1:])


class FlexBertConfig:
    def __init__(self, vocab_size, pad_token_id, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=64, padding="unpadded",
                 use_fa2=True, use_sdpa_attn_mask=False, embed_norm=True, final_norm=False,
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


class FlexBertMLP(nn.Module):
    def __init__(self, config, layer_id=None):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.act = nn.GELU()
        self.drop = nn.Identity()
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        return self.Wo(self.drop(self.act(self.Wi(hidden_states))))


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


class FlexBertUnpadAttention(nn.Module):
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
        self.deterministic_fa2 = False
        self.sliding_window = (-1 // 2, -1 // 2)

    def forward(self, hidden_states, cu_seqlens, max_seqlen, indices, attn_mask):
        bs, dim = hidden_states.shape
        qkv = self.Wqkv(hidden_states)
        qkv = qkv.view(-1, 3, self.num_attention_heads, self.attn_head_size)
        convert_dtype = qkv.dtype not in (torch.float16, torch.bfloat16)
        if convert_dtype:
            # FA2 implementation only supports fp16 and bf16.
            orig_dtype = qkv.dtype
            qkv = qkv.to(torch.bfloat16)
            attn = flash_attn_varlen_qkvpacked_func(
                qkv,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                dropout_p=self.p_dropout,
                deterministic=self.deterministic_fa2,
                window_size=self.sliding_window,
            )
            attn = attn.to(orig_dtype)
        else:
            attn = flash_attn_varlen_qkvpacked_func(
                qkv,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                dropout_p=self.p_dropout,
                deterministic=self.deterministic_fa2,
                window_size=self.sliding_window,
            )
        attn = attn.reshape(bs, dim)
        return self.out_drop(self.Wo(attn))


class FlexBertUnpadPreNormLayer(nn.Module):
    def __init__(self, config, layer_id=None):
        super().__init__()
        self.attn_norm = get_norm_layer(config)
        self.attn = FlexBertUnpadAttention(config, layer_id=layer_id)
        self.mlp_norm = get_norm_layer(config)
        self.mlp = FlexBertMLP(config, layer_id=layer_id)

    def forward(self, hidden_states, cu_seqlens, max_seqlen, indices=None, attn_mask=None):
        attn_out = hidden_states + self.attn(self.attn_norm(hidden_states), cu_seqlens, max_seqlen, indices, attn_mask)
        return attn_out + self.mlp(self.mlp_norm(attn_out))


class FlexBertUnpadEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [FlexBertUnpadPreNormLayer(config, layer_id=i) for i in range(config.num_hidden_layers)]
        )
        self.num_attention_heads = config.num_attention_heads

    def forward(self, hidden_states, attention_mask, indices=None, cu_seqlens=None, max_seqlen=None):
        if indices is None and cu_seqlens is None and max_seqlen is None:
            attention_mask_bool = attention_mask.bool()
            batch, seqlen = hidden_states.shape[:2]
            hidden_states, indices, cu_seqlens, max_seqlen = unpad_input(hidden_states, attention_mask_bool)
            for layer_module in self.layers:
                hidden_states = layer_module(hidden_states, cu_seqlens, max_seqlen, indices, attn_mask=attention_mask)
            return pad_input(hidden_states, indices, batch, seqlen)
        else:
            for layer_module in self.layers:
                hidden_states = layer_module(hidden_states, cu_seqlens, max_seqlen, indices, attn_mask=attention_mask)
            return hidden_states


class FlexBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = FlexBertLinEmbeddings(config)
        self.encoder = FlexBertUnpadEncoder(config)
        self.final_norm = get_norm_layer(config) if config.final_norm else None

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, indices=None,
                cu_seqlens=None, max_seqlen=None, **kwargs):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None and cu_seqlens is not None:
            # positional embeddings start from 0 for every sequence given by cu_seqlens
            assert cu_seqlens.dim() == 1, "cu_seqlens must be 1D tensor"
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
    def __init__(self, vocab_size, pad_token_id, max_length=64, model_kwargs=None):
        super().__init__()
        model_kwargs = model_kwargs or {}
        self.max_length = max_length
        self.config = FlexBertConfig(vocab_size=vocab_size, pad_token_id=pad_token_id, **model_kwargs)
        self.model = FlexBertModel(self.config)

    @property
    def device(self):
        return next(self.parameters()).device

    def _prepare_inputs(self, input_ids, attention_mask):
        """(batch, 1, length) -> flattened (batch * length,) plus cumulative sequence lengths."""
        batch_size, length = input_ids.shape[0], input_ids.shape[2]
        cu_seqlens = torch.tensor([0] + [(i + 1) * length for i in range(batch_size)], dtype=torch.int32,
                                  device=self.device)
        input_ids = input_ids.squeeze(1)
        attention_mask = attention_mask.squeeze(1)
        input_ids = input_ids.view(-1)
        attention_mask = attention_mask.view(-1)
        assert input_ids.max() < self.config.vocab_size
        return input_ids, attention_mask, cu_seqlens

    def tokens_to_latents(self, input_ids, attention_mask):
        if not FIXED:
            input_ids, attention_mask, cu_seqlens = self._prepare_inputs(input_ids, attention_mask)
            with torch.inference_mode():
                return self.model(input_ids, attention_mask=attention_mask, cu_seqlens=cu_seqlens,
                                  max_seqlen=self.max_length)
        with torch.inference_mode():
            if self.config.padding == "unpadded":
                # let the unpadded encoder handle unpadding
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


class Ume(nn.Module):
    def __init__(self, use_flash_attn=True, max_length=64, model_kwargs=None):
        super().__init__()
        model_kwargs = model_kwargs or {}
        model_kwargs["use_fa2"] = use_flash_attn
        if not use_flash_attn:
            model_kwargs["padding"] = "padded"
        self.model = FlexBERT(vocab_size=len(VOCAB), pad_token_id=PAD_ID, max_length=max_length,
                              model_kwargs=model_kwargs)
        self.max_length = max_length
        self.frozen = False

    def freeze(self):
        for p in self.model.parameters():
            p.requires_grad = False
        self.model.eval()
        self.frozen = True

    def embed(self, inputs, aggregate=True):
        x = {k: v.to(self.model.device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        for key in ["input_ids", "attention_mask"]:
            if x[key].dim() == 2:
                x[key] = x[key].unsqueeze(1)
        if self.frozen:
            with torch.no_grad():
                embeddings = self.model.tokens_to_latents(**x)
        else:
            raise NotImplementedError("training path not used here")

        batch_size = x["input_ids"].size(0)
        seq_len = x["input_ids"].size(-1)
        embeddings = embeddings.view(batch_size, seq_len, -1)

        if aggregate:
            # Simple mean pooling over sequence length dimension
            return embeddings.mean(dim=1)
        else:
            return embeddings


def main():
    ume = Ume(use_flash_attn=True)
    ume.freeze()

    proteins = [
        "MKTAYIAKQRQISFVKSHFSRQ",
        "GSHMSLFDFF",
        "MEEPQSDPSV",
        "ACDKLW",
    ]
    max_length = max(len(p) for p in proteins) + 2
    batch = tokenize(proteins, max_length)

    tok = ume.embed(batch, aggregate=False)
    lengths = batch["attention_mask"].squeeze(1).sum(-1).tolist()
    print("token-level embeddings shape:", tuple(tok.shape))
    for p, n, t in zip(proteins, lengths, tok):
        real = t[:n]
        print(f"  {p:<24s} real-token mean first4={[round(v, 4) for v in real.mean(0)[:4].tolist()]}"
              f" <cls> norm={t[0].norm().item():.4f}")

    # the same short protein, embedded on its own (no padding)
    alone = ume.embed(tokenize([proteins[3]], len(proteins[3]) + 2), aggregate=False)[0]
    n3 = lengths[3]
    print("ACDKLW alone: real-token mean first4=%s" % [round(v, 4) for v in alone[:n3].mean(0)[:4].tolist()])
    print("max |ACDKLW in batch - alone| over real tokens = %.6f" % (tok[3, :n3] - alone[:n3]).abs().max().item())

    pooled = ume.embed(batch, aggregate=True)
    print("pooled norms:", [round(v, 4) for v in pooled.norm(dim=-1).tolist()])


if __name__ == "__main__":
    main()
