"""LLaMA-Adapter (v1), shrunk: learned adaption prompts in the top `adapter_layer` layers, attended through a
zero-init gate, both as the repository trains it and as it generates.

Ported from OpenGVLab/LLaMA-Adapter:
  * training: alpaca_finetuning_v1/llama/model.py @fa65dbc2491c57ce3e1849ac0be5ff740fc03500
    (Attention.forward: adapter keys/values concatenated in front of the tokens' keys, `extra_mask` of zeros
    concatenated in front of the causal -inf mask, then two softmaxes: a per-head `gate.tanh()` times the softmax
    over the adapter slice, and the causal softmax over the token slice; Transformer.forward: triu(-inf, 1) mask,
    loss with ignore_index=0) and alpaca_finetuning_v1/finetuning.py (InstructionDataset: right padding with -1,
    then `example[~example_mask] = 0`, `labels[~label_mask] = 0`, the prompt's labels ignored).
  * inference: llama/model.py @91d5912c829d2b657c43b781a5ce2204776ba882 (KV cache written at start_pos,
    `mask = triu(full(-inf), diagonal=start_pos + 1)` only when seqlen > 1, adapter attended by its own softmax
    times a scalar `gate`, added to the output) and llama/generation.py @35a6103b5062ca0127208123bf6b312d44856d28
    (prompts left-aligned in a pad_id=-1 buffer, decoding starts at the shortest prompt's end and
    `torch.where(input_text_mask[:, cur_pos], ...)` keeps the longer prompts' own tokens).
fairscale's parallel layers are plain nn.Linear / nn.Embedding here; float32 on the CPU; greedy decoding.

Checked against every example run alone, unpadded, through a hand-written loop over query positions (keys 0..i,
plus the gated adapter softmax in the adapter layers).
"""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 3
    n_heads: int = 4
    vocab_size: int = 48
    multiple_of: int = 16
    norm_eps: float = 1e-5
    max_batch_size: int = 4
    max_seq_len: int = 24
    adapter_len: int = 3
    adapter_layer: int = 2


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis) -> Tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ----------------------------------------------------------------------------- training (alpaca_finetuning_v1)
class TrainAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_local_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.gate = nn.Parameter(torch.zeros(1, self.n_local_heads, 1, 1))

    def forward(self, x, start_pos, freqs_cis, mask: Optional[torch.Tensor], adapter=None):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        if adapter is not None:
            adapter_len = adapter.shape[1]
            adapter_k = self.wk(adapter).view(1, adapter_len, self.n_local_heads, self.head_dim).repeat(bsz, 1, 1, 1)
            adapter_v = self.wv(adapter).view(1, adapter_len, self.n_local_heads, self.head_dim).repeat(bsz, 1, 1, 1)
            xk = torch.cat([adapter_k, xk], dim=1)
            xv = torch.cat([adapter_v, xv], dim=1)
            extra_mask = torch.zeros(1, 1, seqlen, adapter_len).to(mask)
            mask = torch.cat([extra_mask, mask], dim=-1)
        keys, values = xk, xv
        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        if adapter is not None:
            scores = torch.cat([self.gate.tanh().half() * F.softmax(scores[:, :, :, :adapter_len].float(), dim=-1).type_as(xq),
                                F.softmax(scores[:, :, :, adapter_len:].float(), dim=-1).type_as(xq)], dim=-1)
        else:
            scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class TrainBlock(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.attention = TrainAttention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos, freqs_cis, mask, adapter=None):
        h = x + self.attention.forward(self.attention_norm(x), start_pos, freqs_cis, mask, adapter)
        return h + self.feed_forward.forward(self.ffn_norm(h))


class TrainTransformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.vocab_size = params.vocab_size
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.adapter_query = nn.Embedding(params.adapter_len * params.adapter_layer, params.dim)
        self.adapter_len = params.adapter_len
        self.adapter_layer = params.adapter_layer
        self.criterion = nn.CrossEntropyLoss(ignore_index=0)
        self.layers = nn.ModuleList([TrainBlock(i, params) for i in range(params.n_layers)])
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(params.dim // params.n_heads, params.max_seq_len * 2)

    def forward(self, examples, labels, return_logits=False):
        _bsz, seqlen = examples.shape
        with torch.no_grad():
            h = self.tok_embeddings(examples)
            freqs_cis = self.freqs_cis[:seqlen]
            mask = torch.full((1, 1, seqlen, seqlen), float("-inf"))
            mask = torch.triu(mask, diagonal=0 + 1).type_as(h)
            start_pos = 0
            for layer in self.layers[: -1 * self.adapter_layer]:
                h = layer(h, start_pos, freqs_cis, mask)
        adapter_index = 0
        adapter = self.adapter_query.weight.reshape(-1, self.adapter_len, self.params.dim).unsqueeze(1)
        for layer in self.layers[-1 * self.adapter_layer:]:
            h = layer(h, start_pos, freqs_cis, mask, adapter[adapter_index])
            adapter_index = adapter_index + 1
        h = self.norm(h)
        output = self.output(h)
        if return_logits:
            return output
        output = output[:, :-1, :].reshape(-1, self.vocab_size)
        labels = labels[:, 1:].flatten()
        return self.criterion(output, labels)


def instruction_dataset_item(prompt, answer, max_words):
    """alpaca_finetuning_v1/finetuning.py InstructionDataset.__getitem__ on already tokenized ids."""
    prompt = torch.tensor(prompt, dtype=torch.int64)
    example = torch.tensor(prompt.tolist() + answer, dtype=torch.int64)
    padding = max_words - example.shape[0]
    if padding > 0:
        example = torch.cat((example, torch.zeros(padding, dtype=torch.int64) - 1))
    elif padding < 0:
        example = example[:max_words]
    labels = example.clone()
    labels[: len(prompt)] = -1
    example_mask = example.ge(0)
    label_mask = labels.ge(0)
    example[~example_mask] = 0
    labels[~label_mask] = 0
    return example, labels, example_mask.float()


# ------------------------------------------------------------------------------------- inference (llama/model.py)
class InferAttention(TrainAttention):
    def __init__(self, args):
        super().__init__(args)
        self.cache_k = torch.zeros((args.max_batch_size, args.max_seq_len, self.n_local_heads, self.head_dim))
        self.cache_v = torch.zeros((args.max_batch_size, args.max_seq_len, self.n_local_heads, self.head_dim))
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x, start_pos, freqs_cis, mask, adapter=None):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos: start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos: start_pos + seqlen] = xv
        keys = self.cache_k[:bsz, : start_pos + seqlen]
        values = self.cache_v[:bsz, : start_pos + seqlen]
        if adapter is not None:
            adapter_len = adapter.shape[1]
            adapter_k = self.wk(adapter).view(1, adapter_len, self.n_local_heads, self.head_dim).repeat(bsz, 1, 1, 1)
            adapter_v = self.wv(adapter).view(1, adapter_len, self.n_local_heads, self.head_dim).repeat(bsz, 1, 1, 1)
            adapter_k = adapter_k.transpose(1, 2)
            adapter_v = adapter_v.transpose(1, 2)
        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask  # (bs, n_local_heads, slen, cache_len + slen)
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        if adapter is not None:
            adapter_scores = torch.matmul(xq, adapter_k.transpose(2, 3)) / math.sqrt(self.head_dim)
            adapter_scores = self.gate * F.softmax(adapter_scores.float(), dim=-1).type_as(xq)
            output = output + torch.matmul(adapter_scores, adapter_v)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class InferBlock(TrainBlock):
    def __init__(self, layer_id, args):
        super().__init__(layer_id, args)
        self.attention = InferAttention(args)


class InferTransformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList([InferBlock(i, params) for i in range(params.n_layers)])
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(params.dim // params.n_heads, params.max_seq_len * 2)
        self.adapter_query = nn.Embedding(params.adapter_len * params.adapter_layer, params.dim)

    @torch.inference_mode()
    def forward(self, tokens, start_pos: int):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[start_pos: start_pos + seqlen]
        prompt = self.adapter_query.weight.reshape(self.params.adapter_layer, self.params.adapter_len,
                                                   self.params.dim).unsqueeze(1)
        mask = None
        if seqlen > 1:
            mask = torch.full((1, 1, seqlen, seqlen), float("-inf"))
            mask = torch.triu(mask, diagonal=start_pos + 1).type_as(h)
        for layer in self.layers[: -1 * self.params.adapter_layer]:
            h = layer(h, start_pos, freqs_cis, mask)
        layer_index = 0
        for layer in self.layers[-1 * self.params.adapter_layer:]:
            h = layer(h, start_pos, freqs_cis, mask, prompt[layer_index])
            layer_index = layer_index + 1
        h = self.norm(h)
        return self.output(h[:, -1, :]).float()


def generate(model, prompt_tokens, max_gen_len, pad_id=-1):
    """llama/generation.py LLaMA.generate with temperature 0 (argmax)."""
    bsz = len(prompt_tokens)
    params = model.params
    min_prompt_size = min(len(t) for t in prompt_tokens)
    max_prompt_size = max(len(t) for t in prompt_tokens)
    total_len = min(params.max_seq_len, max_gen_len + max_prompt_size)
    tokens = torch.full((bsz, total_len), pad_id).long()
    for k, t in enumerate(prompt_tokens):
        tokens[k, : len(t)] = torch.tensor(t).long()
    input_text_mask = tokens != pad_id
    start_pos = min_prompt_size
    prev_pos = 0
    for cur_pos in range(start_pos, total_len):
        logits = model.forward(tokens[:, prev_pos:cur_pos], prev_pos)
        next_token = torch.argmax(logits, dim=-1).reshape(-1)
        next_token = torch.where(input_text_mask[:, cur_pos], tokens[:, cur_pos], next_token)
        tokens[:, cur_pos] = next_token
        prev_pos = cur_pos
    return [t[: len(prompt_tokens[i]) + max_gen_len] for i, t in enumerate(tokens.tolist())]


# ------------------------------------------------------------------------------------------------- reference
@torch.no_grad()
def reference_logits(model, ids, gate_of):
    """One unpadded sequence: query i attends keys 0..i; adapter layers add gate * softmax over the adapter."""
    p = model.params
    S = len(ids)
    hd = p.dim // p.n_heads
    x = model.tok_embeddings(torch.tensor(ids))
    freqs = model.freqs_cis[:S]
    adapters = model.adapter_query.weight.reshape(p.adapter_layer, p.adapter_len, p.dim)
    first_adapter_layer = p.n_layers - p.adapter_layer
    for li, layer in enumerate(model.layers):
        att = layer.attention
        hn = layer.attention_norm(x)
        q = att.wq(hn).view(1, S, p.n_heads, hd)
        k = att.wk(hn).view(1, S, p.n_heads, hd)
        v = att.wv(hn).view(S, p.n_heads, hd)
        q, k = apply_rotary_emb(q, k, freqs)
        q, k = q[0], k[0]
        out = torch.zeros(S, p.n_heads, hd)
        for i in range(S):
            for h in range(p.n_heads):
                s = k[: i + 1, h] @ q[i, h] / math.sqrt(hd)
                w = torch.exp(s - s.max())
                out[i, h] = (w / w.sum()) @ v[: i + 1, h]
                if li >= first_adapter_layer:
                    a = adapters[li - first_adapter_layer]
                    ak = att.wk(a).view(p.adapter_len, p.n_heads, hd)[:, h]
                    av = att.wv(a).view(p.adapter_len, p.n_heads, hd)[:, h]
                    sa = ak @ q[i, h] / math.sqrt(hd)
                    wa = torch.exp(sa - sa.max())
                    out[i, h] += gate_of(att, h) * (wa / wa.sum()) @ av
        x = x + att.wo(out.reshape(S, -1))
        x = x + layer.feed_forward(layer.ffn_norm(x))
    return model.output(model.norm(x))


def main():
    args = ModelArgs()
    ok = True

    # ---- training step on a right-padded instruction batch
    torch.manual_seed(1)
    train = TrainTransformer(args).eval()
    with torch.no_grad():
        for layer in train.layers[-args.adapter_layer:]:
            layer.attention.gate.copy_(torch.tensor([0.7, -0.4, 1.1, 0.25]).view(1, 4, 1, 1))
    data = [([1, 7, 12, 5], [20, 31, 2]), ([1, 9, 3], [14, 2]), ([1, 4, 22, 8, 16, 10], [27, 6, 33, 2])]
    max_words = 12
    batch = [instruction_dataset_item(pr, an, max_words) for pr, an in data]
    examples = torch.stack([b[0] for b in batch])
    labels = torch.stack([b[1] for b in batch])
    loss = train(examples, labels)
    logits = train(examples, labels, return_logits=True)

    gate_train = lambda att, h: att.gate.tanh().half().float()[0, h, 0, 0]
    tot, cnt = 0.0, 0
    for b, (pr, an) in enumerate(data):
        ids = pr + an
        ref = reference_logits(train, ids, gate_train)
        m = torch.allclose(logits[b, : len(ids)], ref, atol=1e-4, rtol=1e-4)
        ok &= m
        print(f"train row {b}: logits at real positions match={m}")
        tgt = torch.tensor(ids[1:])
        keep = torch.tensor([0] * (len(pr) - 1) + [1] * len(an), dtype=torch.bool)
        tot += F.cross_entropy(ref[:-1][keep], tgt[keep], reduction="sum").item()
        cnt += int(keep.sum())
    m = abs(loss.item() - tot / cnt) < 1e-4
    ok &= m
    print(f"train loss {loss.item():.6f} vs per-example reference {tot / cnt:.6f}: match={m}")

    # ---- greedy generation through the KV cache, prompts of different lengths
    torch.manual_seed(2)
    infer = InferTransformer(args).eval()
    with torch.no_grad():
        for i, layer in enumerate(infer.layers[-args.adapter_layer:]):
            layer.attention.gate.fill_(0.6 + 0.3 * i)
    prompts = [[1, 7, 12, 5, 30], [1, 9], [1, 4, 22, 8]]
    max_gen_len = 5
    out = generate(infer, prompts, max_gen_len)
    gate_infer = lambda att, h: att.gate[0]
    for b, pr in enumerate(prompts):
        ids = list(pr)
        for _ in range(max_gen_len):
            ids.append(int(reference_logits(infer, ids, gate_infer)[-1].argmax()))
        m = out[b] == ids
        ok &= m
        print(f"generate row {b}: {out[b]} vs alone {ids}: match={m}")

    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
