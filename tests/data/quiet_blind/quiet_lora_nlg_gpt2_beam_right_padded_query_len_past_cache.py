"""LoRA's NLG beam decoder: a hand-written GPT-2 over right-padded queries, a KV cache written at len_past.

Citation: microsoft/LoRA examples/NLG/src/gpt2_beam.py @3732c24dba0559fe4393bfc8f295b83947a2c5e0 (beam,
_reorder_cache, _postprocess_next_token_scores, _calc_banned_ngram_tokens, _add_beam_candidate) and
examples/NLG/src/model.py @3d267d7036b5795e07482fd06d2ad568f95612cc (Attention._attn / forward with len_past,
GPT2Model.forward, GPT2LMModel); the query padding follows examples/NLG/src/data_utils.py (padding_tokens, pads on
the right to max_seq_length). loralib's MergedLinear with lora_attn_dim=0 is a plain Conv1D-style linear, written
as one here; GPT2Config is the project's own config object, shrunk.

How the masking goes: every query is padded on the RIGHT to seq_len and prefilled in one causal pass (the `bias`
buffer, `w * b - 1e10 * (1 - b)`), so a real token never sees the pads after it; the first logits are read at
query_len - 1. Each decode step writes its key/value into the cache slot len_past = query_len + i (over the pad slot
there), takes its position id from len_past, and hides every key slot >= len_past + 1. The cache is reordered by
beam with index_select on the batch dim after every step.

The program checks the batched, padded, cached beam search against a reference that runs the same beam search
one query at a time, unpadded, re-running the whole sequence each step without a cache.

Run as the project's README runs gpt2_beam.py: --batch_size 1 (with --beam, --length_penalty 0.8,
--no_repeat_ngram_size 4). The first step's read-out `logits[_bbatch, _query_len - 1]` indexes the
batch_size * num_beams rows by batch id, which only lines up when batch_size is 1 (microsoft/LoRA#5).
"""
import argparse
import copy
import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parameter import Parameter

parser = argparse.ArgumentParser(description="PyTorch GPT2 beam decoding (tiny, CPU)")
parser.add_argument("--batch_size", type=int, default=1)
parser.add_argument("--seq_len", type=int, default=24, help="query padded length (cache size)")
parser.add_argument("--eval_len", type=int, default=10, help="evaluation length")
parser.add_argument("--min_length", type=int, default=0)
parser.add_argument("--beam", type=int, default=4)
parser.add_argument("--length_penalty", type=float, default=0.8)
parser.add_argument("--no_repeat_ngram_size", type=int, default=4)
parser.add_argument("--repetition_penalty", type=float, default=1.0)
parser.add_argument("--eos_token_id", action="append", type=int, default=[96])
args = parser.parse_args([])


# ----------------------------------------------------------------------------- model.py

def gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-12):
        super(LayerNorm, self).__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super(Conv1D, self).__init__()
        self.nf = nf
        w = torch.empty(nx, nf)
        nn.init.normal_(w, std=0.02)
        self.weight = Parameter(w)
        self.bias = Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        x = x.view(*size_out)
        return x


class Attention(nn.Module):
    def __init__(self, nx, n_ctx, config, scale=False):
        super(Attention, self).__init__()
        n_state = nx
        assert n_state % config.n_head == 0
        self.register_buffer("bias", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))
        self.n_head = config.n_head
        self.split_size = n_state
        self.scale = scale
        # lora.MergedLinear(nx, 3 * n_state, r=config.lora_attn_dim, ...) with lora_attn_dim=0
        self.c_attn = Conv1D(n_state * 3, nx)
        self.c_proj = Conv1D(n_state, nx)
        self.config = config

    def _attn(self, q, k, v, len_kv=None):
        w = torch.matmul(q, k)
        if self.scale:
            w = w / math.sqrt(v.size(-1))
        nd, ns = w.size(-2), w.size(-1)
        b = self.bias[:, :, ns - nd:ns, :ns]
        w = w * b - 1e10 * (1 - b)

        # q : (batch, head, q_seq_length, head_features)
        # k : (batch, head, head_features, kv_seq_length)
        # w : (batch, head, q_seq_length, kv_seq_length)
        # v : (batch, head, kv_seq_length, head_features)
        if len_kv is not None:
            _len = torch.arange(k.size(-1), device=k.device)
            _input_msk = _len[None, :] >= (len_kv)[:, None]
            w = w.masked_fill(_input_msk.unsqueeze(1).unsqueeze(2), -1.0e10)

        w = nn.Softmax(dim=-1)(w)
        return torch.matmul(w, v)

    def merge_heads(self, x):
        x = x.permute(0, 2, 1, 3).contiguous()
        new_x_shape = x.size()[:-2] + (x.size(-2) * x.size(-1),)
        return x.view(*new_x_shape)

    def split_heads(self, x, k=False):
        new_x_shape = x.size()[:-1] + (self.n_head, x.size(-1) // self.n_head)
        x = x.view(*new_x_shape)
        if k:
            return x.permute(0, 2, 3, 1).contiguous()  # (batch, head, head_features, seq_length)
        else:
            return x.permute(0, 2, 1, 3).contiguous()  # (batch, head, seq_length, head_features)

    def forward(self, x, history=None, layer_past=None, len_past=None):
        x = self.c_attn(x)
        query, key, value = x.split(self.split_size, dim=2)

        query = self.split_heads(query)
        key = self.split_heads(key, k=True)
        value = self.split_heads(value)

        len_kv = None

        if layer_past is not None:
            # layer_past, key : (batch, head, seq_length, head_features)
            if len_past is None:
                past_key, past_value = layer_past[0].transpose(-2, -1), layer_past[1]
                key = torch.cat((past_key, key), dim=-1)
                value = torch.cat((past_value, value), dim=-2)
            else:
                key_seq = key.shape[-1]
                assert key_seq == 1

                _batch = torch.arange(0, key.shape[0], dtype=torch.long, device=key.device)

                past_key, past_value = layer_past[0], layer_past[1]

                past_key[_batch, :, len_past, :] = key.squeeze(-1)
                past_value[_batch, :, len_past, :] = value.squeeze(-2)

                key = past_key.transpose(-2, -1)
                value = past_value

                len_kv = len_past + 1

        present = torch.stack((key.transpose(-2, -1), value))  # transpose to have same shapes for stacking
        a = self._attn(query, key, value, len_kv=len_kv)
        a = self.merge_heads(a)
        a = self.c_proj(a)
        return a, present


class MLP(nn.Module):
    def __init__(self, n_state, config):
        super(MLP, self).__init__()
        nx = config.n_embd
        self.c_fc = Conv1D(n_state, nx)
        self.c_proj = Conv1D(nx, n_state)
        self.act = gelu

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_ctx, config, scale=False):
        super(Block, self).__init__()
        nx = config.n_embd
        self.ln_1 = LayerNorm(nx, eps=config.layer_norm_epsilon)
        self.attn = Attention(nx, n_ctx, config, scale)
        self.ln_2 = LayerNorm(nx, eps=config.layer_norm_epsilon)
        self.mlp = MLP(4 * nx, config)

    def forward(self, x, layer_past=None, len_past=None):
        a, present = self.attn(self.ln_1(x), layer_past=layer_past, len_past=len_past)
        x = x + a
        m = self.mlp(self.ln_2(x))
        x = x + m
        return x, present


class GPT2Model(nn.Module):
    def __init__(self, config):
        super(GPT2Model, self).__init__()
        self.n_layer = config.n_layer
        self.n_embd = config.n_embd
        self.n_vocab = config.vocab_size

        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        block = Block(config.n_ctx, config, scale=True)
        self.h = nn.ModuleList([copy.deepcopy(block) for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

        self.config = config

    def forward(self, input_ids, position_ids=None, token_type_ids=None, past=None, len_past=None):
        if past is None:
            past_length = 0
            past = [None] * len(self.h)
        elif len_past is None:
            past_length = past[0][0].size(-2)

        if position_ids is None and len_past is None:
            position_ids = torch.arange(
                past_length, input_ids.size(-1) + past_length, dtype=torch.long, device=input_ids.device
            )
            position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        elif len_past is not None:
            position_ids = (len_past).unsqueeze(1)

        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_ids.size(-1))
        position_ids = position_ids.view(-1, position_ids.size(-1))

        inputs_embeds = self.wte(input_ids)
        position_embeds = self.wpe(position_ids)

        if token_type_ids is not None:
            token_type_ids = token_type_ids.view(-1, token_type_ids.size(-1))
            token_type_embeds = self.wte(token_type_ids)
        else:
            token_type_embeds = 0
        hidden_states = inputs_embeds + position_embeds + token_type_embeds
        presents = []
        for block, layer_past in zip(self.h, past):
            hidden_states, present = block(hidden_states, layer_past=layer_past, len_past=len_past)
            presents.append(present)
        hidden_states = self.ln_f(hidden_states)
        output_shape = input_shape + (hidden_states.size(-1),)
        return hidden_states.view(*output_shape), presents


class GPT2LMHead(nn.Module):
    def __init__(self, model_embeddings_weights, config):
        super(GPT2LMHead, self).__init__()
        self.n_embd = config.n_embd
        self.set_embeddings_weights(model_embeddings_weights)

    def set_embeddings_weights(self, model_embeddings_weights):
        embed_shape = model_embeddings_weights.shape
        self.decoder = nn.Linear(embed_shape[1], embed_shape[0], bias=False)
        self.decoder.weight = model_embeddings_weights  # Tied weights

    def forward(self, hidden_state):
        return self.decoder(hidden_state)


class GPT2Config(object):
    def __init__(
        self,
        vocab_size_or_config_json_file=50257,
        n_positions=1024,
        n_ctx=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        layer_norm_epsilon=1e-5,
        initializer_range=0.02,
        lora_attn_dim=0,
        lora_attn_alpha=128,
        lora_dropout=0.0,
    ):
        self.vocab_size = vocab_size_or_config_json_file
        self.n_ctx = n_ctx
        self.n_positions = n_positions
        self.n_embd = n_embd
        self.n_layer = n_layer
        self.n_head = n_head
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.lora_attn_dim = lora_attn_dim
        self.lora_attn_alpha = lora_attn_alpha
        self.lora_dropout = lora_dropout


class GPT2LMModel(nn.Module):
    def __init__(self, config):
        super(GPT2LMModel, self).__init__()
        self.transformer = GPT2Model(config)
        self.lm_head = GPT2LMHead(self.transformer.wte.weight, config)
        self.apply(self._init_weights)

    def forward(self, input_ids, past=None, len_past=None):
        hidden_states, presents = self.transformer(input_ids, past=past, len_past=len_past)
        lm_logits = self.lm_head(hidden_states)
        return lm_logits, presents

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()


# ----------------------------------------------------------------------------- data_utils.py

def padding_tokens(tokens, max_seq_length, pad_token, direct, max_context_length=0):
    if max_context_length == 0:
        max_context_length = max_seq_length

    if len(tokens) > max_context_length:
        if direct > 0:
            pad_tokens = tokens[:max_context_length]
        else:
            pad_tokens = tokens[-max_context_length:]
    else:
        pad_tokens = tokens
    token_len = len(pad_tokens)
    pad_tokens = pad_tokens + [pad_token for _ in range(max_seq_length - token_len)]
    return pad_tokens, token_len


def collate_queries(contexts, seq_len):
    """What FT_Dataset.__getitem__ + the DataLoader give gpt2_beam.py: id, query, query_len."""
    query, query_len = zip(*(padding_tokens(c, seq_len, 0, -1) for c in contexts))
    return {
        "id": torch.arange(len(contexts)),
        "query": torch.tensor(query, dtype=torch.long),
        "query_len": torch.tensor(query_len, dtype=torch.long),
    }


# ----------------------------------------------------------------------------- gpt2_beam.py

def _reorder_cache(past: Tuple, beam_idx: Tensor) -> Tuple[Tensor]:
    return tuple(layer_past.index_select(1, beam_idx).contiguous().detach() for layer_past in past)


def _calc_banned_ngram_tokens(prev_input_ids: Tensor, num_hypos: int, no_repeat_ngram_size: int, cur_len: int):
    """Copied from fairseq for no_repeat_ngram in beam_search"""
    if cur_len + 1 < no_repeat_ngram_size:
        return [[] for _ in range(num_hypos)]

    generated_ngrams = [{} for _ in range(num_hypos)]
    for idx in range(num_hypos):
        gen_tokens = prev_input_ids[idx].tolist()
        generated_ngram = generated_ngrams[idx]
        for ngram in zip(*[gen_tokens[i:] for i in range(no_repeat_ngram_size)]):
            prev_ngram_tuple = tuple(ngram[:-1])
            generated_ngram[prev_ngram_tuple] = generated_ngram.get(prev_ngram_tuple, []) + [ngram[-1]]

    def _get_generated_ngrams(hypo_idx):
        start_idx = cur_len + 1 - no_repeat_ngram_size
        ngram_idx = tuple(prev_input_ids[hypo_idx, start_idx:cur_len].tolist())
        return generated_ngrams[hypo_idx].get(ngram_idx, [])

    return [_get_generated_ngrams(hypo_idx) for hypo_idx in range(num_hypos)]


def _postprocess_next_token_scores(
    scores,
    history,
    cur_len,
    batch_size,
    num_beams,
    repetition_penalty=1.0,
    no_repeat_ngram_size=4,
    min_length=0,
    eos_token_id=None,
):
    if eos_token_id is not None and cur_len < min_length:
        for eos in eos_token_id:
            scores[:, eos] = -float("inf")

    if no_repeat_ngram_size > 0 and history is not None:
        num_batch_hypotheses = batch_size * num_beams
        banned_batch_tokens = _calc_banned_ngram_tokens(history, num_batch_hypotheses, no_repeat_ngram_size, cur_len)
        for i, banned_tokens in enumerate(banned_batch_tokens):
            scores[i, banned_tokens] = -float("inf")

    return scores


def _add_beam_candidate(best_score, best_sequence, batch_size, num_beams, beam_scores, history, eos_token_id=None):
    last_tokens = history[:, -1]
    for _i in range(batch_size * num_beams):
        if eos_token_id is None or last_tokens[_i] in eos_token_id:
            cur_len = history.shape[-1]
            _score = beam_scores.view(-1)[_i] / cur_len ** args.length_penalty

            batch_id = _i // num_beams

            if batch_id not in best_score or best_score[batch_id] < _score:
                best_score[batch_id] = _score
                best_sequence[batch_id][:cur_len] = history[_i]

            beam_scores.view(-1)[_i] = -float("inf")


def beam(model, data_iter, args):
    model.eval()
    all_predictions = {}
    with torch.no_grad():
        for data in data_iter:
            _id = data["id"]
            _query = data["query"]
            _query_len = data["query_len"]

            batch_size = _id.size(0)
            num_beams = args.beam

            _batch = torch.arange(0, _id.size(0), dtype=torch.long)

            past = None
            len_past = None

            _query = _query.repeat(1, num_beams).view(batch_size * num_beams, -1)
            _query_len = _query_len.unsqueeze(-1).repeat(1, num_beams).view(-1)

            _bbatch = _batch.unsqueeze(-1).repeat(1, num_beams).view(-1)

            beam_scores = torch.zeros((batch_size, num_beams), dtype=torch.float)

            best_sequence = torch.zeros((batch_size, args.eval_len), dtype=torch.long)
            best_score = {}

            history = None
            for i in range(0, args.eval_len):
                if i == 0:
                    logits, past = model(_query)
                    logits = logits[_bbatch, (_query_len - 1).long(), :]  # batch_size * beam, vocab
                else:
                    logits, past = model(token_id, past=past, len_past=len_past)
                    logits = logits[:, -1, :]  # batch_size * beam, vocab

                logits = _postprocess_next_token_scores(
                    logits,
                    history,
                    i,
                    batch_size,
                    num_beams,
                    repetition_penalty=args.repetition_penalty,
                    no_repeat_ngram_size=args.no_repeat_ngram_size,
                    min_length=args.min_length,
                    eos_token_id=args.eos_token_id,
                )

                softmax_probs = F.softmax(logits, dim=-1)
                vocab_size = softmax_probs.shape[-1]
                _logprob = torch.log(softmax_probs)  # batch_size * beam, vocab
                if i == 0:
                    next_scores = _logprob.view(batch_size, num_beams, -1)[:, 0, :]  # batch_size, vocab
                else:
                    next_scores = beam_scores.unsqueeze(-1) + _logprob.view(batch_size, num_beams, -1)
                    next_scores = next_scores.view(batch_size, -1)  # batch_size, beam * vocab

                next_scores, next_tokens = torch.topk(next_scores, num_beams, dim=1, largest=True, sorted=True)

                beam_id = (next_tokens // vocab_size).view(-1)  # batch_size * num_beams
                token_id = (next_tokens % vocab_size).view(-1).unsqueeze(-1)

                beam_idx = beam_id.view(batch_size, num_beams) + (_batch * num_beams).unsqueeze(-1)
                past = _reorder_cache(past, beam_idx.view(-1))
                beam_scores = next_scores
                len_past = (_query_len + i).long()

                if history is None:
                    history = token_id.detach()
                else:
                    history = torch.cat((history[beam_idx.view(-1)], token_id.detach()), dim=1).detach()

                _add_beam_candidate(
                    best_score, best_sequence, batch_size, num_beams, beam_scores, history,
                    eos_token_id=args.eos_token_id,
                )

            _add_beam_candidate(best_score, best_sequence, batch_size, num_beams, beam_scores, history)

            for _b in range(batch_size):
                _i = int(_id[_b].item())
                all_predictions[_i] = {"id": _i, "predict": best_sequence[_b].tolist(),
                                       "score": float(best_score[_b])}
    return all_predictions


# ----------------------------------------------------------------------------- reference

def reference_beam(model, context, args):
    """The same search for one query: no padding, no cache, the whole sequence re-run every step."""
    num_beams, vocab = args.beam, model.transformer.n_vocab
    hyps = [[]]  # one hypothesis before the first step, as the batched code reads beam 0 only
    scores = [0.0]
    best = (None, None)
    for i in range(args.eval_len):
        rows = []
        for h, s in zip(hyps, scores):
            ids = torch.tensor([context + h])
            logits = model(ids)[0][0, -1].clone()
            if i < args.min_length:
                logits[args.eos_token_id] = -float("inf")
            n = args.no_repeat_ngram_size
            if n > 0 and i + 1 >= n:
                seen = {}
                for g in zip(*[h[k:] for k in range(n)]):
                    seen.setdefault(tuple(g[:-1]), []).append(g[-1])
                logits[seen.get(tuple(h[i + 1 - n:i]), [])] = -float("inf")
            rows.append(s + torch.log_softmax(logits, -1))
        flat = torch.stack(rows).view(-1)
        top, idx = torch.topk(flat, num_beams)
        hyps = [hyps[j // vocab] + [j % vocab] for j in idx.tolist()]
        scores = top.tolist()
        for b in range(num_beams):
            if hyps[b][-1] in args.eos_token_id or i == args.eval_len - 1:
                cand = scores[b] / len(hyps[b]) ** args.length_penalty
                if best[0] is None or best[0] < cand:
                    best = (cand, hyps[b])
                scores[b] = -float("inf")
    seq = best[1] + [0] * (args.eval_len - len(best[1]))
    return seq, best[0]


def main():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size_or_config_json_file=97, n_positions=64, n_ctx=64, n_embd=32, n_layer=2, n_head=4,
    )
    lm_net = GPT2LMModel(config)
    # a trained model's wte is not N(0, 0.02): spread the logits so the beams disagree
    with torch.no_grad():
        lm_net.transformer.wte.weight.normal_(0.0, 0.5)
        lm_net.transformer.wpe.weight.normal_(0.0, 0.5)
    lm_net.eval()

    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (5, 11, 3, 8)]
    batches = [collate_queries(contexts[k:k + args.batch_size], args.seq_len)
               for k in range(0, len(contexts), args.batch_size)]
    for k, batch in enumerate(batches):
        batch["id"] = batch["id"] + k * args.batch_size

    predictions = beam(lm_net, batches, args)

    worst = 0.0
    with torch.no_grad():
        for _i, context in enumerate(contexts):
            ref_seq, ref_score = reference_beam(lm_net, context, args)
            got = predictions[_i]
            assert got["predict"] == ref_seq, (_i, got["predict"], ref_seq)
            worst = max(worst, abs(got["score"] - ref_score))
            print(f"query {_i} (len {len(context):2d}): {got['predict']}  score {got['score']:.4f}")
    assert worst < 1e-4, worst
    print(f"right-padded cached beam search (len_past) == unpadded uncached reference (score err {worst:.1e})")


if __name__ == "__main__":
    main()
