# ESPnet-style BatchBeamSearch over one utterance (the running hypotheses are the batch rows, n_beam of them), with a
# Transformer decoder whose `forward_one_step` embeds the whole prefix `ys` again and hands each later layer its cached
# outputs (ESPnet's TransformerDecoder.batch_score). After the top-k the hypotheses are reindexed by `prev_hyp`, but
# the bug forgets `select_state` on the decoder's states, so from the second layer on a row attends to the cached
# states of the hypothesis that sat in it before. SDPA kernel; config kept as a dataclass. --fixed selects the states.
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class DecoderConfig:
    vocab: int = 24
    d_model: int = 32
    heads: int = 4
    layers: int = 3
    beam: int = 4
    max_len: int = 7


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.h = cfg.heads
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(4))

    def forward(self, query, key, value):
        b, lq, d = query.shape
        split = lambda t: t.view(b, -1, self.h, d // self.h).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q(query)), split(self.k(key)), split(self.v(value)))
        return self.o(y.transpose(1, 2).reshape(b, lq, d))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.self_attn, self.src_attn = Attention(cfg), Attention(cfg)
        self.n1, self.n2, self.n3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, 64), nn.ReLU(), nn.Linear(64, cfg.d_model))

    def forward(self, tgt, memory, cache=None):
        h = self.n1(tgt)
        q = h[:, -1:]  # only the newest position is computed: the earlier ones are the cache
        x = tgt[:, -1:] + self.self_attn(q, h, h)
        x = x + self.src_attn(self.n2(x), memory, memory)
        x = x + self.ff(self.n3(x))
        return x if cache is None else torch.cat([cache, x], dim=1)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.max_len + 1, cfg.d_model) * 0.1)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.out = nn.Linear(cfg.d_model, cfg.vocab)

    def batch_score(self, ys, states, memory):
        x = self.embed(ys) + self.pos[: ys.size(1)]
        new_states = []
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, None if states is None else states[i])
            new_states.append(x)
        return torch.log_softmax(self.out(x[:, -1]), dim=-1), new_states


def select_state(states, prev_hyp):
    return [s.index_select(0, prev_hyp) for s in states]


def beam_search(decoder: Decoder, memory: torch.Tensor, cfg: DecoderConfig, sos: int = 1):
    yseq = torch.full((cfg.beam, 1), sos, dtype=torch.long)
    scores = torch.tensor([0.0] + [float("-inf")] * (cfg.beam - 1))
    memory = memory.expand(cfg.beam, -1, -1)
    states = None
    for _ in range(cfg.max_len):
        logp, states = decoder.batch_score(yseq, states, memory)
        weighted = (scores[:, None] + logp).view(-1)
        scores, flat = weighted.topk(cfg.beam)
        prev_hyp, token = flat // cfg.vocab, flat % cfg.vocab
        yseq = torch.cat([yseq[prev_hyp], token[:, None]], dim=1)
        if FIXED:
            states = select_state(states, prev_hyp)
    return yseq, scores


def main():
    torch.manual_seed(3)
    cfg = DecoderConfig()
    decoder = Decoder(cfg).eval()
    memory = torch.randn(1, 9, cfg.d_model)
    with torch.no_grad():
        yseq, scores = beam_search(decoder, memory, cfg)
    print("best", yseq[0].tolist(), round(float(scores[0]), 4))


if __name__ == "__main__":
    main()
