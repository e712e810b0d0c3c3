# Citation: karpathy/nano-llama31 @06461cada7744a7da86a408f094549800b6bee3f, llama31.py (ModelArgs with flash,
#   precompute_freqs_cis / apply_rotary_emb on real-valued freqs, KVCache(nn.Module).update, Attention.forward with
#   F.scaled_dot_product_attention(xq, xk, xv, mask) or the eager scores + mask path, Transformer.forward_inference,
#   Llama.generate installing a KVCache per layer, sample_top_p with its own generator).
# nano-Llama 3.1's batched generation: prompts are written into a (bsz, total_len) buffer right-padded with
# tokenizer.pad_id; the first forward covers only the columns [0, min_prompt_len) every prompt has, with the
# additive -inf triu mask hstacked after start_pos zero columns; then one column per step at start_pos = prev_pos
# (no mask when seqlen == 1). A longer prompt's own token replaces the sampled one while input_text_mask is True,
# so every cached column holds a real token and pads are never fed. Run with flash=False (eager softmax) and
# flash=True (SDPA with the additive mask), greedy and top-p sampling.
# Checked against each prompt alone (unpadded, no cache: the whole sequence re-run every step): the generated
# tokens, cut at the stop token, for both attention paths; in top-p sampled runs every token lies in the
# nucleus of the reference's probabilities for that row's prefix.
import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
DEVICE = "cpu"


class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = -1
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000
    use_scaled_rope: bool = False
    max_batch_size: int = 32
    max_seq_len: int = 2048
    flash: bool = False  # use flash attention?

    def __init__(self, **kwargs):
        for k, v in kwargs.items():
            if hasattr(self, k):
                setattr(self, k, v)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        assert self.n_kv_heads <= self.n_heads
        assert self.n_heads % self.n_kv_heads == 0
        assert self.dim % self.n_heads == 0


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0, use_scaled: bool = False):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    assert not use_scaled
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex64
    freqs_cis_real = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return freqs_cis_real


def apply_rotary_emb(x, freqs_cis):
    # x is (bs, seqlen, n_heads, head_dim); freqs_cis is (seq_len, head_dim/2, 2)
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class KVCache(nn.Module):
    def __init__(self, batch_size, seq_length, n_kv_heads, head_dim, dtype, device):
        super().__init__()
        cache_shape = (batch_size, seq_length, n_kv_heads, head_dim)
        self.register_buffer("cache_k", torch.zeros(cache_shape, dtype=dtype, device=device))
        self.register_buffer("cache_v", torch.zeros(cache_shape, dtype=dtype, device=device))

    def update(self, start_pos, xk, xv):
        seqlen = xk.size(1)
        self.cache_k[:, start_pos : start_pos + seqlen] = xk
        self.cache_v[:, start_pos : start_pos + seqlen] = xv
        xk = self.cache_k[:, : start_pos + seqlen]
        xv = self.cache_v[:, : start_pos + seqlen]
        return xk, xv


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.flash = args.flash
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        model_parallel_size = 1
        self.n_local_heads = args.n_heads // model_parallel_size
        self.n_local_kv_heads = self.n_kv_heads // model_parallel_size
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads

        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

        # will be KVCache object managed by inference context manager
        self.cache = None

    def forward(self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor, mask: Optional[torch.Tensor]):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq = apply_rotary_emb(xq, freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis)
        if self.cache is not None:
            xk, xv = self.cache.update(start_pos, xk, xv)
        xk = repeat_kv(xk, self.n_rep)
        xv = repeat_kv(xv, self.n_rep)
        xq, xk, xv = (x.transpose(1, 2) for x in (xq, xk, xv))
        if self.flash:
            output = F.scaled_dot_product_attention(xq, xk, xv, mask)
        else:
            scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)
            if mask is not None:
                scores = scores + mask  # (bs, n_local_heads, seqlen, cache_len + seqlen)
            scores = F.softmax(scores.float(), dim=-1).type_as(xq)
            output = torch.matmul(scores, xv)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        proj = self.wo(output)
        return proj


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]):
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
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.head_dim = args.dim // args.n_heads
        self.attention = Attention(args)
        self.feed_forward = FeedForward(
            dim=args.dim, hidden_dim=4 * args.dim, multiple_of=args.multiple_of,
            ffn_dim_multiplier=args.ffn_dim_multiplier,
        )
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(TransformerBlock(params) for _ in range(params.n_layers))
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(
            params.dim // params.n_heads, params.max_seq_len * 2, params.rope_theta, params.use_scaled_rope,
        )

    def forward_inference(self, tokens: torch.Tensor, start_pos: int):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]

        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)
            mask = torch.triu(mask, diagonal=1)
            # the matrix of scores is of size (seqlen, cache_len + seqlen), and the only masked entries are (i, j)
            # for j > cache_len + i, since row i corresponds to token cache_len + i.
            mask = torch.hstack([torch.zeros((seqlen, start_pos), device=tokens.device), mask]).type_as(h)

        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        h = self.norm(h)
        output = self.output(h).float()
        return output


class Tokenizer:
    # only the ids generate() reads
    def __init__(self, pad_id, stop_tokens):
        self.pad_id = pad_id
        self.stop_tokens = list(stop_tokens)


class Llama:
    def __init__(self, model: Transformer, tokenizer: Tokenizer):
        self.model = model
        self.tokenizer = tokenizer

    @torch.inference_mode()
    def generate(self, prompt_tokens: List[List[int]], sample_rng: torch.Generator, max_gen_len: int,
                 temperature: float = 0.6, top_p: float = 0.9, echo: bool = False) -> List[List[int]]:
        params = self.model.params
        bsz = len(prompt_tokens)
        assert bsz <= params.max_batch_size, (bsz, params.max_batch_size)

        min_prompt_len = min(len(t) for t in prompt_tokens)
        max_prompt_len = max(len(t) for t in prompt_tokens)
        assert max_prompt_len <= params.max_seq_len
        total_len = min(params.max_seq_len, max_gen_len + max_prompt_len)

        # install KV cache in all the Attention layers
        for block in self.model.layers:
            layer_dtype = block.attention.wq.weight.dtype
            layer_device = block.attention.wq.weight.device
            block.attention.cache = KVCache(
                batch_size=bsz, seq_length=total_len, n_kv_heads=params.n_kv_heads,
                head_dim=params.dim // params.n_heads, dtype=layer_dtype, device=layer_device,
            )

        pad_id = self.tokenizer.pad_id
        tokens = torch.full((bsz, total_len), pad_id, dtype=torch.long, device=DEVICE)
        for k, t in enumerate(prompt_tokens):
            tokens[k, : len(t)] = torch.tensor(t, dtype=torch.long, device=DEVICE)

        prev_pos = 0
        eos_reached = torch.tensor([False] * bsz, device=DEVICE)
        input_text_mask = tokens != pad_id

        if min_prompt_len == total_len:
            logits = self.model.forward_inference(tokens, prev_pos)

        stop_tokens = torch.tensor(list(self.tokenizer.stop_tokens))

        for cur_pos in range(min_prompt_len, total_len):
            logits = self.model.forward_inference(tokens[:, prev_pos:cur_pos], prev_pos)
            if temperature > 0:
                probs = torch.softmax(logits[:, -1] / temperature, dim=-1)
                next_token = sample_top_p(probs, top_p, sample_rng)
            else:
                next_token = torch.argmax(logits[:, -1], dim=-1)
            next_token = next_token.reshape(-1)
            # only replace token if prompt has already been generated
            next_token = torch.where(input_text_mask[:, cur_pos], tokens[:, cur_pos], next_token)
            tokens[:, cur_pos] = next_token
            eos_reached |= (~input_text_mask[:, cur_pos]) & (torch.isin(next_token, stop_tokens))
            prev_pos = cur_pos
            if all(eos_reached):
                break

        out_tokens = []
        for i, toks in enumerate(tokens.tolist()):
            start = 0 if echo else len(prompt_tokens[i])
            toks = toks[start : len(prompt_tokens[i]) + max_gen_len]
            for stop_token in self.tokenizer.stop_tokens:
                try:
                    eos_idx = toks.index(stop_token)
                    toks = toks[:eos_idx]
                except ValueError:
                    pass
            out_tokens.append(toks)

        # clean up the KV cache in all the layers
        for block in self.model.layers:
            block.attention.cache = None

        return out_tokens


def sample_top_p(probs, p, generator):
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    mask = probs_sum - probs_sort > p
    probs_sort[mask] = 0.0
    probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))
    next_token = torch.multinomial(probs_sort, num_samples=1, generator=generator)
    next_token = torch.gather(probs_idx, -1, next_token)
    return next_token


# ----------------------------------------------------------------------------- reference


@torch.inference_mode()
def reference_next_logits(model, seq):
    # one sequence alone, no cache installed, the whole prefix re-run
    for block in model.layers:
        assert block.attention.cache is None
    return model.forward_inference(torch.tensor([seq]), 0)[0, -1]


def reference_greedy(model, prompt, max_gen_len, stop_tokens):
    seq = list(prompt)
    out = []
    for _ in range(max_gen_len):
        tok = int(torch.argmax(reference_next_logits(model, seq)))
        out.append(tok)
        seq.append(tok)
        if tok in stop_tokens:
            break
    for stop_token in stop_tokens:
        if stop_token in out:
            out = out[: out.index(stop_token)]
    return out


def main():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=80, multiple_of=16,
                     rope_theta=10000.0, max_batch_size=4, max_seq_len=40)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.25)
    model.eval()

    pad_id = 79
    g = torch.Generator().manual_seed(3)
    lens = [4, 9, 6, 12]
    prompts = [torch.randint(0, 79, (n,), generator=g).tolist() for n in lens]
    max_gen_len = 8

    ref_free = [reference_greedy(model, p, max_gen_len, []) for p in prompts]
    # a stop token that row 2 reaches part way through
    stop = ref_free[2][3]
    assert stop not in ref_free[2][:3] and stop != pad_id
    refs = [reference_greedy(model, p, max_gen_len, [stop]) for p in prompts]
    assert any(len(r) < max_gen_len for r in refs) and any(len(r) == max_gen_len for r in refs)

    for flash in (False, True):
        for block in model.layers:
            block.attention.flash = flash
        llama = Llama(model, Tokenizer(pad_id=pad_id, stop_tokens=[stop]))
        out = llama.generate(prompts, torch.Generator().manual_seed(0), max_gen_len, temperature=0.0)
        assert out == refs, (flash, out, refs)

        # top-p sampling: the batch draws one multinomial over all rows per step; replay each row alone with the
        # reference's probabilities and the draws the batched run made
        temperature, top_p = 0.8, 0.9
        rng = torch.Generator().manual_seed(11)
        out_s = llama.generate(prompts, rng, max_gen_len, temperature=temperature, top_p=top_p)
        for b, prompt in enumerate(prompts):
            seq = list(prompt)
            got = out_s[b]
            for j, tok in enumerate(got + ([stop] if len(got) < max_gen_len else [])):
                probs = torch.softmax(reference_next_logits(model, seq) / temperature, dim=-1)
                probs_sort, probs_idx = torch.sort(probs, descending=True)
                keep = (torch.cumsum(probs_sort, -1) - probs_sort) <= top_p
                assert tok in probs_idx[keep].tolist(), (flash, b, j, tok)
                seq.append(tok)
    print("ok: greedy outputs of both attention paths equal each prompt alone; sampled tokens in the reference nucleus")


if __name__ == "__main__":
    main()
