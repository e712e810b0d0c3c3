"""Condenser (luyug/Condenser) dense-retrieval pre-training, shrunk.

Ported from luyug/Condenser @19d0990585d645e423ecaa8a98a018c1b1d0fbb8:
  modeling.py  CondenserForPretraining.forward / mlm_loss
  data.py      CondenserCollator.__call__ / _pad (right padding to max_seq_length,
               mlm mask labels padded with 0 so pads carry label -100)
The backbone is HF BertForMaskedLM as it was in transformers 4.x (the version Condenser
used), written here in plain torch at tiny size: BertModel.get_extended_attention_mask
turns the (B, L) 0/1 mask into an additive (B, 1, 1, L) bias (1 - m) * -10000.0 that every
layer adds to its scores; output_hidden_states returns the embeddings plus every layer.

Condenser builds that same extended mask itself and reuses it for its extra head: the
head input is the [CLS] vector of the LAST backbone layer concatenated with the token
vectors of an EARLY layer (skip_from), run through n_head_layers fresh BertLayers with the
same (B, 1, 1, L) bias; the MLM loss is taken on the head output (plus the backbone's own
late MLM loss). Pads are right-side keys hidden by the bias; pad query rows are computed
and ignored through label -100.

The check: hidden states and both MLM losses of the padded batch match each sequence run
alone, unpadded, through the same weights with no mask at all.
"""
import math
import random
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
random.seed(0)


# ---------------------------------------------------------------- BERT (transformers 4.x, plain torch)
def gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class BertEmbeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)
        self.register_buffer("position_ids", torch.arange(c.max_position_embeddings).expand((1, -1)))

    def forward(self, input_ids, token_type_ids=None):
        seq_length = input_ids.size(1)
        position_ids = self.position_ids[:, :seq_length]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        e = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids) \
            + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(e))


class BertSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.num_attention_heads = c.num_attention_heads
        self.attention_head_size = c.hidden_size // c.num_attention_heads
        self.all_head_size = c.hidden_size
        self.query = nn.Linear(c.hidden_size, self.all_head_size)
        self.key = nn.Linear(c.hidden_size, self.all_head_size)
        self.value = nn.Linear(c.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(c.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        x = x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size))
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        q = self.transpose_for_scores(self.query(hidden_states))
        k = self.transpose_for_scores(self.key(hidden_states))
        v = self.transpose_for_scores(self.value(hidden_states))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # Apply the attention mask (precomputed for all layers in BertModel forward() function)
            scores = scores + attention_mask
        probs = self.dropout(nn.Softmax(dim=-1)(scores))
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return ctx.view(ctx.size()[:-2] + (self.all_head_size,))


class BertLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self = BertSelfAttention(c)
        self.attn_out = nn.Linear(c.hidden_size, c.hidden_size)
        self.attn_ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.intermediate = nn.Linear(c.hidden_size, c.intermediate_size)
        self.output = nn.Linear(c.intermediate_size, c.hidden_size)
        self.out_ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None):
        a = self.self(hidden_states, attention_mask)
        a = self.attn_ln(self.dropout(self.attn_out(a)) + hidden_states)
        o = self.output(gelu(self.intermediate(a)))
        o = self.out_ln(self.dropout(o) + a)
        return (o,)


class BertModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.embeddings = BertEmbeddings(c)
        self.layer = nn.ModuleList([BertLayer(c) for _ in range(c.num_hidden_layers)])

    def get_extended_attention_mask(self, attention_mask, input_shape, device):
        # transformers 4.x ModuleUtilsMixin.get_extended_attention_mask (encoder branch)
        if attention_mask.dim() == 3:
            extended_attention_mask = attention_mask[:, None, :, :]
        elif attention_mask.dim() == 2:
            extended_attention_mask = attention_mask[:, None, None, :]
        else:
            raise ValueError(f"Wrong shape for input_ids (shape {input_shape})")
        extended_attention_mask = extended_attention_mask.to(dtype=torch.float32)
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        return extended_attention_mask

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        ext = self.get_extended_attention_mask(attention_mask, input_ids.shape, input_ids.device)
        h = self.embeddings(input_ids)
        all_hidden = (h,)
        for layer in self.layer:
            h = layer(h, ext)[0]
            all_hidden = all_hidden + (h,)
        return h, all_hidden


class BertOnlyMLMHead(nn.Module):
    def __init__(self, c, word_embeddings):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.decoder_weight = word_embeddings.weight            # tied
        self.bias = nn.Parameter(torch.zeros(c.vocab_size))

    def forward(self, h):
        h = self.LayerNorm(gelu(self.dense(h)))
        return h @ self.decoder_weight.T + self.bias


class BertForMaskedLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.bert = BertModel(c)
        self.cls = BertOnlyMLMHead(c, self.bert.embeddings.word_embeddings)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.normal_(0.0, 0.1)   # "trained" LayerNorms
            module.weight.data.uniform_(0.7, 1.3)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.normal_(0.0, 0.05)

    def get_extended_attention_mask(self, attention_mask, input_shape, device):
        return self.bert.get_extended_attention_mask(attention_mask, input_shape, device)

    def forward(self, input_ids, attention_mask=None, labels=None, output_hidden_states=True, return_dict=True):
        seq, hidden = self.bert(input_ids, attention_mask)
        logits = self.cls(seq)
        loss = None
        if labels is not None:
            loss = nn.CrossEntropyLoss()(logits.view(-1, self.config.vocab_size), labels.view(-1))
        return SimpleNamespace(loss=loss, logits=logits, hidden_states=hidden)


# ---------------------------------------------------------------- Condenser (modeling.py, ported)
class CondenserForPretraining(nn.Module):
    def __init__(self, bert, model_args):
        super().__init__()
        self.lm = bert
        self.c_head = nn.ModuleList([BertLayer(bert.config) for _ in range(model_args.n_head_layers)])
        self.c_head.apply(self.lm._init_weights)
        self.cross_entropy = nn.CrossEntropyLoss()
        self.model_args = model_args

    def forward(self, model_input, labels):
        attention_mask = self.lm.get_extended_attention_mask(
            model_input['attention_mask'],
            model_input['attention_mask'].shape,
            model_input['attention_mask'].device
        )
        lm_out = self.lm(**model_input, labels=labels, output_hidden_states=True, return_dict=True)
        cls_hiddens = lm_out.hidden_states[-1][:, :1]
        skip_hiddens = lm_out.hidden_states[self.model_args.skip_from]
        hiddens = torch.cat([cls_hiddens, skip_hiddens[:, 1:]], dim=1)
        for layer in self.c_head:
            layer_out = layer(hiddens, attention_mask)
            hiddens = layer_out[0]
        loss = self.mlm_loss(hiddens, labels)
        if self.model_args.late_mlm:
            loss += lm_out.loss
        self._last = (hiddens, lm_out)
        return loss

    def mlm_loss(self, hiddens, labels):
        pred_scores = self.lm.cls(hiddens)
        return self.cross_entropy(pred_scores.view(-1, self.lm.config.vocab_size), labels.view(-1))


# ---------------------------------------------------------------- data.py (ported, tokenizer-free)
PAD, CLS, SEP, MASK = 0, 1, 2, 3


def collate(texts, max_seq_length, vocab_size, mlm_probability=0.3):
    """CondenserCollator.__call__: [CLS] text [SEP] padded right to max_seq_length; the
    whole-word mask labels are `_pad([0] + mlm_mask)` so [CLS], [SEP] and pads are never
    predicted; then DataCollatorForWholeWordMask.mask_tokens (80% [MASK], 10% random, 10% keep)."""
    def _pad(seq, val=0):
        assert len(seq) <= max_seq_length
        return seq + [val for _ in range(max_seq_length - len(seq))]

    encoded, masks, mlm_masks = [], [], []
    for t in texts:
        n_pred = max(1, int(round(len(t) * mlm_probability)))
        chosen = set(random.sample(range(len(t)), n_pred))
        mlm_masks.append(_pad([0] + [1 if i in chosen else 0 for i in range(len(t))]))
        ids = [CLS] + t + [SEP]
        masks.append(_pad([1] * len(ids)))
        encoded.append(_pad(ids, PAD))
    inputs = torch.tensor(encoded)
    mask_labels = torch.tensor(mlm_masks)
    labels = inputs.clone()
    probability_matrix = mask_labels.bool()
    labels[~probability_matrix] = -100
    g = torch.Generator().manual_seed(3)
    replaced = torch.bernoulli(torch.full(labels.shape, 0.8), generator=g).bool() & probability_matrix
    inputs[replaced] = MASK
    rnd = torch.bernoulli(torch.full(labels.shape, 0.5), generator=g).bool() & probability_matrix & ~replaced
    inputs[rnd] = torch.randint(4, vocab_size, labels.shape, generator=g)[rnd]
    return {"input_ids": inputs, "labels": labels, "attention_mask": torch.tensor(masks)}


# ---------------------------------------------------------------- independent reference
def ref_layer(layer, x):
    """A BertLayer on ONE unpadded sequence x (n, D): plain full attention, no mask."""
    sa = layer.self
    H, dh = sa.num_attention_heads, sa.attention_head_size
    n = x.size(0)
    q = sa.query(x).view(n, H, dh).transpose(0, 1)
    k = sa.key(x).view(n, H, dh).transpose(0, 1)
    v = sa.value(x).view(n, H, dh).transpose(0, 1)
    w = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(dh), dim=-1)
    ctx = (w @ v).transpose(0, 1).reshape(n, H * dh)
    a = layer.attn_ln(layer.attn_out(ctx) + x)
    return layer.out_ln(layer.output(gelu(layer.intermediate(a))) + a)


def ref_condenser(model, ids, skip_from):
    bert = model.lm.bert
    e = bert.embeddings
    n = len(ids)
    ids = torch.tensor(ids)
    x = e.LayerNorm(e.word_embeddings(ids) + e.token_type_embeddings(torch.zeros_like(ids))
                    + e.position_embeddings(torch.arange(n)))
    hs = [x]
    for layer in bert.layer:
        x = ref_layer(layer, x)
        hs.append(x)
    head = torch.cat([hs[-1][:1], hs[skip_from][1:]], dim=0)
    for layer in model.c_head:
        head = ref_layer(layer, head)
    return hs, head


def main():
    c = SimpleNamespace(vocab_size=40, hidden_size=16, num_attention_heads=2, num_hidden_layers=4,
                        intermediate_size=32, max_position_embeddings=32, type_vocab_size=2,
                        layer_norm_eps=1e-12, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                        initializer_range=0.2, pad_token_id=PAD)
    model_args = SimpleNamespace(n_head_layers=2, skip_from=2, late_mlm=True)
    model = CondenserForPretraining(BertForMaskedLM(c), model_args)
    model.eval()

    texts = [
        [5, 9, 12, 33, 7, 21, 18, 4, 26, 14],
        [11, 30, 6, 19],
        [8, 25, 17, 36, 10, 22],
        [13, 29],
    ]
    max_seq_length = 12
    batch = collate(texts, max_seq_length, c.vocab_size)
    labels = batch.pop("labels")
    ok = True
    with torch.no_grad():
        loss = model(batch, labels)
        head_out, lm_out = model._last
        head_ce, late_ce, count = 0.0, 0.0, 0
        for b, t in enumerate(texts):
            n = len(t) + 2
            ids = batch["input_ids"][b, :n].tolist()
            assert batch["attention_mask"][b, :n].all() and not batch["attention_mask"][b, n:].any()
            hs, head = ref_condenser(model, ids, model_args.skip_from)
            for li, h in enumerate(hs):
                ok &= torch.allclose(lm_out.hidden_states[li][b, :n], h, atol=1e-5)
            ok &= torch.allclose(head_out[b, :n], head, atol=1e-5)
            lab = labels[b, :n]
            sel = lab != -100
            ok &= bool((labels[b, n:] == -100).all())
            head_ce += F.cross_entropy(model.lm.cls(head)[sel], lab[sel], reduction="sum").item()
            late_ce += F.cross_entropy(model.lm.cls(hs[-1])[sel], lab[sel], reduction="sum").item()
            count += int(sel.sum())
        ref_loss = head_ce / count + late_ce / count
        ok &= abs(loss.item() - ref_loss) < 1e-4

    print("Condenser head over padded batch matches each sequence alone:", bool(ok))
    assert ok


if __name__ == "__main__":
    main()
