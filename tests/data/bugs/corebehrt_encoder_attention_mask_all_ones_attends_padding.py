# Citation: FGA-DIKU/BONSAI#164 (repository then named FGA-DIKU/EHR; CoreBEHRT), fixed in
#   PR #247, commit 9e2de21 ("Causal attention (#247)": "consistently precompute attention_mask").
#   Buggy code read at commit 033102e (corebehrt/modules/model/model.py, embeddings.py, heads.py).
# Upstream: corebehrt/modules/model/model.py, CorebehrtEncoder.forward (subclass of
#   transformers ModernBertModel), used by CorebehrtForFineTuning with FineTuneHead/BiGRU.
# Bug: CorebehrtEncoder.forward built `attention_mask = torch.ones_like(batch["concept"])`, so
#   ModernBERT's bidirectional mask let every EHR event attend to the padded tail of shorter
#   patient sequences (whose Time2Vec age/abspos + segment embeddings are not zero).
# Fix: use batch["attention_mask"] when present, else `(batch["concept"] != PAD).float()`.
import sys

import torch
import torch.nn as nn
from transformers import ModernBertConfig, ModernBertModel

FIXED = "--fixed" in sys.argv

# corebehrt.constants
ATTENTION_MASK = "attention_mask"
CONCEPT_FEAT = "concept"
SEGMENT_FEAT = "segment"
AGE_FEAT = "age"
ABSPOS_FEAT = "abspos"
TARGET = "target"
PAD_TOKEN = "[PAD]"
DEFAULT_VOCABULARY = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3, "[MASK]": 4}
TIME2VEC_AGE_SCALE = 1e-2
TIME2VEC_AGE_SHIFT = 0.0
TIME2VEC_ABSPOS_SCALE = 1e-4
TIME2VEC_ABSPOS_SHIFT = 0.0
TIME2VEC_MIN_CLIP = -100.0
TIME2VEC_MAX_CLIP = 100.0


class Time2Vec(torch.nn.Module):
    def __init__(self, output_dim=768, function=torch.cos, shift=0, scale=1, clip_min=None, clip_max=None):
        super().__init__()
        self.f = function
        self.clip_min = clip_min
        self.clip_max = clip_max
        self.w0 = torch.nn.Parameter(torch.randn(1, 1))
        self.phi0 = torch.nn.Parameter(torch.randn(1))
        self.w = torch.nn.Parameter(torch.randn(1, output_dim - 1))
        self.phi = torch.nn.Parameter(torch.randn(output_dim - 1))
        self.shift = shift
        self.scale = scale

    def forward(self, tau):
        tau = (tau + self.shift) * self.scale
        tau = tau.unsqueeze(2)
        linear_1 = torch.matmul(tau, self.w0) + self.phi0
        linear_2 = torch.matmul(tau, self.w)
        if self.clip_min is not None or self.clip_max is not None:
            linear_1 = torch.clamp(linear_1, self.clip_min, self.clip_max)
        periodic = self.f(linear_2 + self.phi)
        return torch.cat((linear_1, periodic), dim=-1)


class EhrEmbeddings(nn.Module):
    def __init__(self, vocab_size, hidden_size, type_vocab_size, embedding_dropout, pad_token_id=0,
                 age_scale=TIME2VEC_AGE_SCALE, abspos_scale=TIME2VEC_ABSPOS_SCALE,
                 age_shift=TIME2VEC_AGE_SHIFT, abspos_shift=TIME2VEC_ABSPOS_SHIFT):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(hidden_size)
        self.dropout = nn.Dropout(embedding_dropout)
        self.concept_embeddings = nn.Embedding(vocab_size, hidden_size, padding_idx=pad_token_id)
        self.segment_embeddings = nn.Embedding(type_vocab_size, hidden_size)
        self.age_embeddings = Time2Vec(hidden_size, shift=age_shift, scale=age_scale,
                                       clip_min=TIME2VEC_MIN_CLIP, clip_max=TIME2VEC_MAX_CLIP)
        self.abspos_embeddings = Time2Vec(hidden_size, shift=abspos_shift, scale=abspos_scale,
                                          clip_min=TIME2VEC_MIN_CLIP, clip_max=TIME2VEC_MAX_CLIP)

    def forward(self, input_ids, segments=None, age=None, abspos=None, inputs_embeds=None):
        if inputs_embeds is not None:
            return inputs_embeds
        embeddings = self.concept_embeddings(input_ids)
        embeddings += self.segment_embeddings(segments)
        embeddings += self.age_embeddings(age)
        embeddings += self.abspos_embeddings(abspos)
        embeddings = self.LayerNorm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


class BiGRU(torch.nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.rnn = torch.nn.GRU(hidden_size, hidden_size, batch_first=True, bidirectional=True)
        self.classifier = torch.nn.Linear(hidden_size * 2, 1)

    def forward(self, hidden_states, attention_mask):
        lengths = attention_mask.sum(dim=1).cpu()
        packed = torch.nn.utils.rnn.pack_padded_sequence(
            hidden_states, lengths, batch_first=True, enforce_sorted=False)
        output, _ = self.rnn(packed)
        output, _ = torch.nn.utils.rnn.pad_packed_sequence(output, batch_first=True)
        last_sequence_idx = lengths - 1
        forward_output = output[torch.arange(output.shape[0]), last_sequence_idx, : self.hidden_size]
        backward_output = output[:, 0, self.hidden_size:]
        x = torch.cat((forward_output, backward_output), dim=-1)
        return self.classifier(x)


class FineTuneHead(torch.nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.classifier = torch.nn.Linear(hidden_size, 1)
        self.pool = BiGRU(hidden_size)

    def forward(self, hidden_states, attention_mask):
        return self.pool(hidden_states, attention_mask=attention_mask)


class CorebehrtEncoder(ModernBertModel):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = EhrEmbeddings(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            type_vocab_size=config.type_vocab_size,
            embedding_dropout=config.embedding_dropout,
            pad_token_id=config.pad_token_id,
            age_scale=getattr(config, "age_scale", TIME2VEC_AGE_SCALE),
            age_shift=getattr(config, "age_shift", TIME2VEC_AGE_SHIFT),
            abspos_scale=getattr(config, "abspos_scale", TIME2VEC_ABSPOS_SCALE),
            abspos_shift=getattr(config, "abspos_shift", TIME2VEC_ABSPOS_SHIFT),
        )

    def forward(self, batch: dict):
        if FIXED:
            if ATTENTION_MASK in batch:
                attention_mask = batch[ATTENTION_MASK]
            else:
                attention_mask = (batch[CONCEPT_FEAT] != DEFAULT_VOCABULARY[PAD_TOKEN]).float()
        else:
            attention_mask = torch.ones_like(batch["concept"])

        inputs_embeds = self.embeddings(
            input_ids=batch["concept"],
            segments=batch["segment"],
            age=batch["age"],
            abspos=batch["abspos"],
        )
        return super().forward(inputs_embeds=inputs_embeds, attention_mask=attention_mask)


class CorebehrtForFineTuning(CorebehrtEncoder):
    def __init__(self, config):
        super().__init__(config)
        self.loss_fct = nn.BCEWithLogitsLoss()
        self.cls = FineTuneHead(hidden_size=config.hidden_size)

    def forward(self, batch: dict):
        outputs = super().forward(batch)
        sequence_output = outputs[0]
        logits = self.cls(sequence_output, batch["attention_mask"])
        outputs.logits = logits
        if batch.get("target") is not None:
            outputs.loss = self.get_loss(logits, batch["target"])
        return outputs

    def get_loss(self, hidden_states, labels):
        return self.loss_fct(hidden_states.view(-1), labels.view(-1))


def make_batch():
    # three patients with 12, 7 and 4 events, right-padded (dataset collate: pad 0 everywhere)
    g = torch.Generator().manual_seed(1)
    lengths = [12, 7, 4]
    L = max(lengths)
    concept = torch.zeros(3, L, dtype=torch.long)
    segment = torch.zeros(3, L, dtype=torch.long)
    age = torch.zeros(3, L)
    abspos = torch.zeros(3, L)
    attention_mask = torch.zeros(3, L, dtype=torch.long)
    for i, n in enumerate(lengths):
        concept[i, 0] = DEFAULT_VOCABULARY["[CLS]"]
        concept[i, 1:n] = torch.randint(5, 40, (n - 1,), generator=g)
        visits = torch.sort(torch.randint(0, 4, (n,), generator=g)).values
        segment[i, :n] = visits
        start_age = 40 + 30 * torch.rand(1, generator=g)
        age[i, :n] = start_age + visits.float() * 0.5
        abspos[i, :n] = 450000 + visits.float() * 4380 + torch.rand(n, generator=g) * 24
        attention_mask[i, :n] = 1
    target = torch.tensor([1.0, 0.0, 1.0])
    return {"concept": concept, "segment": segment, "age": age, "abspos": abspos,
            "attention_mask": attention_mask, "target": target}


def main():
    torch.manual_seed(0)
    config = ModernBertConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, local_attention=8,
        global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, attention_dropout=0.0,
        embedding_dropout=0.0, mlp_dropout=0.0,
    )
    config.type_vocab_size = 8
    config._attn_implementation = "eager"
    model = CorebehrtForFineTuning(config).eval()
    batch = make_batch()
    with torch.no_grad():
        out = model(batch)
    print("mode:", "fixed" if FIXED else "buggy")
    print("logits:", [round(v, 5) for v in out.logits.view(-1).tolist()])
    print("loss:", round(out.loss.item(), 6))


if __name__ == "__main__":
    main()
