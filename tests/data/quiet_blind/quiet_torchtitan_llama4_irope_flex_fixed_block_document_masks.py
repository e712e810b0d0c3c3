# Citation: pytorch/torchtitan torchtitan/models/llama4/model/model.py @018740b7aae7846d24954539244c78215dbd181f
#   (TransformerBlock: every_n_layers_nope -> use_rope / fixed_attn_block_size, Attention.forward picking
#   attention_masks["rope" if self.use_rope else "nope"], Transformer.get_attention_masks) and
#   torchtitan/models/attention.py (get_causal_mask_mod, get_document_mask_mod, get_fixed_block_mask_mod,
#   create_attention_mask, FlexAttentionWrapper).
# Llama 4 iRoPE pre-training over packed rows (attn_mask_type="block_causal"): documents end with EOS, and the
# document mask is built from an EOS cumsum. RoPE layers attend causally within their document AND within the same
# fixed block of fixed_attn_block_size row positions (chunked local attention); every every_n_layers_nope-th layer
# (NoPE) attends causally within its document over the whole row. One BlockMask per kind, picked per layer.
# Trimmed: no MoE (interleave_moe_layer_step past n_layers), no PEFT; flex_attention and create_block_mask run
# uncompiled on CPU (torchtitan wraps both in torch.compile).
# Checked against a dense reference built with a double loop and an eager softmax over the same weights, and against
# each row's first document run alone. The step's loss is taken under no_grad (FlexAttention has no CPU backward).
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

torch.manual_seed(0)


@dataclass
class TransformerModelArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 96
    multiple_of: int = 16
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 64
    attn_type: str = "flex"
    attn_mask_type: str = "block_causal"
    every_n_layers_nope: int | None = 4
    fixed_attn_block_size: int = 8
    interleave_moe_layer_step: int = 1000


class Tokenizer:
    eos_id = 2


# ---- torchtitan/models/attention.py ----
def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def get_causal_mask_mod():
    return _causal_mask


def get_document_mask_mod(batch, eos_id):
    # batch is [b, s, h, d] shape
    eos_mask = batch == eos_id
    eos_mask[:, -1] = True
    cumulative_mask = torch.cumsum(torch.where(eos_mask, 1, 0), dim=1)
    sequence_indices = torch.zeros_like(cumulative_mask, dtype=torch.int32)
    sequence_indices[:, 1:] = cumulative_mask[:, :-1]

    def document_mask(b, h, q_idx, kv_idx):
        return sequence_indices[b, q_idx] == sequence_indices[b, kv_idx]

    return document_mask


def get_fixed_block_mask_mod(fixed_block_size):
    # Credit to @drisspg.
    def blocked_mask_mod(b, h, q_idx, kv_idx):
        # Get the block index of the query and key
        q_block = q_idx // fixed_block_size
        kv_block = kv_idx // fixed_block_size
        # Only allow attention within the same block
        return q_block == kv_block

    blocked_mask_mod.__name__ = f"blocked_mask_mod_fixed_block_size_{fixed_block_size}"
    return blocked_mask_mod


def create_attention_mask(*args, **kwargs):
    return create_block_mask(*args, **kwargs, device="cpu")


class FlexAttentionWrapper(nn.Module):
    def forward(self, q, k, v, *, block_mask, scale=None):
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)


# ---- torchtitan/models/llama4/model/model.py ----
def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    assert freqs_cis.shape == (seqlen, x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class Attention(nn.Module):
    def __init__(self, model_args, use_rope=True, fixed_block_size=None):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = model_args.n_heads if model_args.n_kv_heads is None else model_args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = model_args.dim // model_args.n_heads
        self.wq = nn.Linear(model_args.dim, model_args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(model_args.n_heads * self.head_dim, model_args.dim, bias=False)
        self.use_rope = use_rope
        self.attn_type = model_args.attn_type
        self.inner_attention = FlexAttentionWrapper()

    def project(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        if self.use_rope:
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        return xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)

    def forward(self, x, freqs_cis, attention_masks):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.project(x, freqs_cis)
        assert isinstance(attention_masks, dict), attention_masks
        attention_mask = attention_masks["rope" if self.use_rope else "nope"]
        output = self.inner_attention(xq, xk, xv, block_mask=attention_mask)
        output = output.transpose(1, 2).contiguous()
        output = output.view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of, ffn_dim_multiplier):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id, model_args):
        super().__init__()
        attn_use_rope = True
        fixed_attn_block_size = None
        if model_args.every_n_layers_nope is not None:
            if model_args.every_n_layers_nope <= 1:
                raise ValueError("every_n_layers_nope must be greater than 1")
            if layer_id % model_args.every_n_layers_nope == 0:
                attn_use_rope = False
            else:
                fixed_attn_block_size = model_args.fixed_attn_block_size
        self.attention = Attention(model_args, attn_use_rope, fixed_attn_block_size)
        self.moe_enabled = (layer_id + 1) % model_args.interleave_moe_layer_step == 0
        assert not self.moe_enabled
        self.feed_forward = FeedForward(model_args.dim, 4 * model_args.dim, model_args.multiple_of,
                                        model_args.ffn_dim_multiplier)
        self.attention_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)

    def forward(self, x, freqs_cis, attention_masks):
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(model_args.dim // model_args.n_heads,
                                                               model_args.max_seq_len, model_args.rope_theta),
                             persistent=False)
        self.layers = nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = TransformerBlock(layer_id, model_args)
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)

    def get_attention_masks(self, input_batch, tokenizer, extra_inputs=None):
        mask_mods = [get_causal_mask_mod()]
        match self.model_args.attn_mask_type:
            case "causal":
                B = 1
            case "block_causal":
                mask_mods.append(get_document_mask_mod(input_batch, tokenizer.eos_id))
                B = input_batch.shape[0]
            case _:
                raise ValueError(f"Unknown attention mask type: {self.model_args.attn_mask_type}")
        rope_mask_mod = and_masks(*mask_mods, get_fixed_block_mask_mod(self.model_args.fixed_attn_block_size))
        nope_mask_mod = and_masks(*mask_mods)
        seqlen = input_batch.shape[1]
        return {
            "rope": create_attention_mask(rope_mask_mod, B, None, seqlen, seqlen),
            "nope": create_attention_mask(nope_mask_mod, B, None, seqlen, seqlen),
        }

    def forward(self, tokens, attention_masks=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks)
        h = self.norm(h)
        return self.output(h)


# ---- a dense reference: masks from a double loop, eager softmax ----
def reference_keep(tokens, eos_id, use_rope, block):
    bsz, seqlen = tokens.shape
    keep = torch.zeros(bsz, seqlen, seqlen, dtype=torch.bool)
    for b in range(bsz):
        doc, doc_of = 0, []
        for t in range(seqlen):
            doc_of.append(doc)
            if tokens[b, t].item() == eos_id:
                doc += 1
        for q in range(seqlen):
            for k in range(q + 1):
                if doc_of[q] != doc_of[k]:
                    continue
                if use_rope and q // block != k // block:
                    continue
                keep[b, q, k] = True
    return keep


def reference_forward(model, tokens, eos_id):
    args = model.model_args
    h = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        attn = layer.attention
        x = layer.attention_norm(h)
        xq, xk, xv = attn.project(x, model.freqs_cis)
        keep = reference_keep(tokens, eos_id, attn.use_rope, args.fixed_attn_block_size)
        scores = xq @ xk.transpose(-1, -2) / math.sqrt(attn.head_dim)
        scores = scores.masked_fill(~keep[:, None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ xv
        out = out.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[1], -1)
        h = h + attn.wo(out)
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h))


def pack(doc_lens, seqlen, eos_id, vocab):
    row = []
    for n in doc_lens:
        body = torch.randint(3, vocab, (n - 1,)).tolist()
        row += body + [eos_id]
    assert len(row) >= seqlen
    return row[:seqlen]


def main():
    args = TransformerModelArgs()
    tok = Tokenizer()
    model = Transformer(args).eval()
    seqlen = 32
    # documents crossing the 8-token fixed blocks; the last document of each row is cut at seqlen
    docs = [[5, 13, 7, 11], [20, 4, 9], [3, 9, 6, 17]]
    tokens = torch.tensor([pack(d, seqlen, tok.eos_id, args.vocab_size) for d in docs])
    labels = torch.roll(tokens, -1, dims=1)

    with torch.no_grad():
        masks = model.get_attention_masks(tokens, tok)
        logits = model(tokens, attention_masks=masks)
        ref = reference_forward(model, tokens, tok.eos_id)
    err = (logits - ref).abs().max().item()
    print(f"flex vs dense reference: max abs diff {err:.2e}")
    assert err < 1e-4, err

    # each row's first document starts at position 0, so its fixed blocks are the same when run alone
    with torch.no_grad():
        for b, d in enumerate(docs):
            n = d[0]
            alone = tokens[b:b + 1, :n]
            out = model(alone, attention_masks=model.get_attention_masks(alone, tok))
            e = (out[0] - logits[b, :n]).abs().max().item()
            print(f"row {b} first document ({n} tokens) alone: max abs diff {e:.2e}")
            assert e < 1e-4, e

    # the loss the trainer takes on the packed rows (FlexAttention has no CPU backward, so no step here)
    with torch.no_grad():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
