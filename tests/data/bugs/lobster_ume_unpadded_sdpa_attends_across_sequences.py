# prescient-design/lobster commit fd2fbe2 (PR #112, after #105): Ume(use_flash_attn=False) built FlexBERT with the
# "unpadded" architecture, whose non-FA2 FlexBertUnpadAttention runs SDPA over all total_nnz tokens of the batch with
# no mask, so every sequence attends to every other sequence; the fix switches to padded + use_sdpa_attn_mask=True.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- bert_padding helpers (flash_attn.bert_padding, as vendored by lobster) ----
def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    b, s = hidden_states.shape[:2]
    return hidden_states.reshape(b * s, -1)[indices], indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])


class FlexBertConfig:
    def __init__(self, padding="unpadded", use_fa2=True, use_sdpa_attn_mask=False, vocab_size=33, pad_token_id=1,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, hidden_size=32, max_position=64):
        self.padding = padding
        self.use_fa2 = use_fa2
        self.use_sdpa_attn_mask = use_sdpa_attn_mask
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        self.max_position = max_position


class FlexBertAttentionBase(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attn_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = config.hidden_size
        self.p_dropout = 0.0
        self.use_fa2 = config.use_fa2
        self.use_sdpa_attn_mask = config.use_sdpa_attn_mask
        self.Wqkv = nn.Linear(config.hidden_size, 3 * self.all_head_size, bias=False)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.out_drop = nn.Identity()


class FlexBertUnpadAttention(FlexBertAttentionBase):
    def forward(self, hidden_states, cu_seqlens, max_seqlen, indices, attn_mask):
        bs, dim = hidden_states.shape
        qkv = self.Wqkv(hidden_states)
        assert not self.use_fa2  # CPU: flash_attn not available
        # Use native unpadded SDPA without padding/unpadding
        qkv = qkv.view(-1, 3, self.num_attention_heads, self.attn_head_size)
        q, k, v = qkv.unbind(dim=1)  # Each has shape (total_nnz, num_heads, head_dim)
        # Reshape for SDPA: (num_heads, total_nnz, head_dim)
        q = q.transpose(0, 1)
        k = k.transpose(0, 1)
        v = v.transpose(0, 1)
        if self.p_dropout > 0.0:
            attn = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p_dropout)
        else:
            attn = F.scaled_dot_product_attention(q, k, v)
        attn = attn.transpose(0, 1)
        attn = attn.reshape(bs, dim)
        return self.out_drop(self.Wo(attn))


class FlexBertPaddedAttention(FlexBertAttentionBase):
    def forward(self, hidden_states, attn_mask=None):
        bs, seqlen, dim = hidden_states.shape
        qkv = self.Wqkv(hidden_states)
        assert not self.use_fa2
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
    def __init__(self, config):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.act = nn.SiLU()
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.Wo(self.act(self.Wi(x)))


class FlexBertUnpadPreNormLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size)
        self.attn = FlexBertUnpadAttention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size)
        self.mlp = FlexBertMLP(config)

    def forward(self, hidden_states, cu_seqlens, max_seqlen, indices=None, attn_mask=None):
        attn_out = hidden_states + self.attn(self.attn_norm(hidden_states), cu_seqlens, max_seqlen, indices, attn_mask)
        return attn_out + self.mlp(self.mlp_norm(attn_out))


class FlexBertPaddedPreNormLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size)
        self.attn = FlexBertPaddedAttention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size)
        self.mlp = FlexBertMLP(config)

    def forward(self, hidden_states, attn_mask=None):
        attn_out = hidden_states + self.attn(self.attn_norm(hidden_states), attn_mask)
        return attn_out + self.mlp(self.mlp_norm(attn_out))


class FlexBertUnpadEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([FlexBertUnpadPreNormLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask, indices=None, cu_seqlens=None, max_seqlen=None):
        if indices is None and cu_seqlens is None and max_seqlen is None:
            attention_mask_bool = attention_mask.bool()
            batch, seqlen = hidden_states.shape[:2]
            hidden_states, indices, cu_seqlens, max_seqlen = unpad_input(hidden_states, attention_mask_bool)
            for layer_module in self.layers:
                hidden_states = layer_module(hidden_states, cu_seqlens, max_seqlen, indices, attn_mask=attention_mask)
            return pad_input(hidden_states, indices, batch, seqlen)
        raise NotImplementedError


class FlexBertPaddedEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([FlexBertPaddedPreNormLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask, **kwargs):
        for layer_module in self.layers:
            hidden_states = layer_module(hidden_states, attn_mask=attention_mask)
        return hidden_states


class FlexBertAbsoluteEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position, config.hidden_size)
        self.norm = nn.RMSNorm(config.hidden_size)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1]).unsqueeze(0)
        return self.norm(self.tok_embeddings(input_ids) + self.position_embeddings(position_ids))


class FlexBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = FlexBertAbsoluteEmbeddings(config)
        self.encoder = FlexBertUnpadEncoder(config) if config.padding == "unpadded" else FlexBertPaddedEncoder(config)

    def forward(self, input_ids, attention_mask=None, indices=None, cu_seqlens=None, max_seqlen=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        embeddings = self.embeddings(input_ids)
        return self.encoder(hidden_states=embeddings, attention_mask=attention_mask, indices=indices,
                            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


class FlexBERT(nn.Module):
    def __init__(self, model_kwargs=None):
        super().__init__()
        self.config = FlexBertConfig(**(model_kwargs or {}))
        self.model = FlexBertModel(self.config)

    @torch.inference_mode()
    def tokens_to_latents(self, input_ids, attention_mask):
        if input_ids.dim() == 3:
            input_ids = input_ids.squeeze(1)
        if attention_mask.dim() == 3:
            attention_mask = attention_mask.squeeze(1)
        return self.model(input_ids=input_ids, attention_mask=attention_mask)


class Ume(nn.Module):
    def __init__(self, use_flash_attn=True, model_kwargs=None, ckpt_path=None):
        super().__init__()
        model_kwargs = model_kwargs or {}
        model_kwargs["use_fa2"] = use_flash_attn
        if not FIXED:
            if ckpt_path is not None:
                # Always use unpadded architecture when loading from checkpoint
                model_kwargs["padding"] = "unpadded"
            elif not use_flash_attn:
                # For checkpoint compatibility, default to unpadded architecture
                # Only use padded architecture if explicitly requested
                model_kwargs["padding"] = model_kwargs.get("padding", "unpadded")
        else:
            if ckpt_path is not None:
                model_kwargs["padding"] = "unpadded"
                if not use_flash_attn:
                    model_kwargs["use_sdpa_attn_mask"] = True
            else:
                # When creating a new model, choose the appropriate architecture
                if use_flash_attn:
                    # Flash attention works with unpadded architecture
                    model_kwargs["padding"] = "unpadded"
                else:
                    # SDPA requires padded architecture to work correctly
                    model_kwargs["padding"] = "padded"
                    model_kwargs["use_sdpa_attn_mask"] = True
        self.model = FlexBERT(model_kwargs=model_kwargs)

    def embed(self, inputs, aggregate=True):
        x = {k: v for k, v in inputs.items()}
        for key in ["input_ids", "attention_mask"]:
            if x[key].dim() == 2:
                x[key] = x[key].unsqueeze(1)
        embeddings = self.model.tokens_to_latents(x["input_ids"], x["attention_mask"])
        batch_size = x["input_ids"].size(0)
        seq_len = x["input_ids"].size(-1)
        if self.model.config.padding == "unpadded":
            embeddings = embeddings.view(batch_size, seq_len, -1)
        if aggregate:
            embeddings = embeddings.mean(dim=1)
        return embeddings


# CPU inference: flash-attn unavailable -> use_flash_attn=False
ume = Ume(use_flash_attn=False).eval()
print("padding =", ume.model.config.padding, " use_sdpa_attn_mask =", ume.model.config.use_sdpa_attn_mask)

lengths = [20, 7, 13]
L = max(lengths)
input_ids = torch.full((len(lengths), L), 1, dtype=torch.long)
attention_mask = torch.zeros(len(lengths), L, dtype=torch.long)
for i, n in enumerate(lengths):
    input_ids[i, :n] = torch.randint(4, 33, (n,))
    attention_mask[i, :n] = 1

batched = ume.embed({"input_ids": input_ids, "attention_mask": attention_mask}, aggregate=False)
max_diff = 0.0
for i, n in enumerate(lengths):
    alone = ume.embed({"input_ids": input_ids[i:i + 1, :n], "attention_mask": attention_mask[i:i + 1, :n]},
                      aggregate=False)
    max_diff = max(max_diff, (batched[i, :n] - alone[0]).abs().max().item())
print(f"max |batched - alone| over real tokens: {max_diff:.6f}")
