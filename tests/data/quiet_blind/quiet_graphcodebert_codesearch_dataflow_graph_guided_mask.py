"""GraphCodeBERT code search: graph-guided (data-flow) attention mask over a padded batch.

Port of microsoft/CodeBERT @15034c0783fe4da7e6339312cd760e060b6daba1
  GraphCodeBERT/codesearch/run.py   convert_examples_to_features (layout, position_idx)
                                    TextDataset.__getitem__       (attn_mask)
  GraphCodeBERT/codesearch/model.py Model.forward                 (node embeddings, encoder call)
The encoder is the RoBERTa of the transformers 3.x era that GraphCodeBERT ran on
(get_extended_attention_mask turns a 3-D [B, L, L] 0/1 mask into (1 - m[:, None]) * -10000),
written here in plain torch at tiny sizes.

Sequence layout per example (length code_length + data_flow_length):
  [<s>, code tokens..., </s>] [dfg nodes (unk id)...] [<pad>...]
  position_idx: code -> 2, 3, ...;  dfg nodes -> 0;  pad -> 1 (pad id)
Mask: code<->code full; <s>/</s> rows see every non-pad position; dfg node <-> the code
tokens it comes from (both directions); dfg node -> the dfg nodes it reads from (one way).
Pad rows stay all-False on purpose (finite -10000 fill, output unused).
"""
import math
import numpy as np
import torch
import torch.nn as nn

torch.manual_seed(0)
np.random.seed(0)

CLS, PAD, SEP, UNK = 0, 1, 2, 3
VOCAB, HID, HEADS, LAYERS, FF = 40, 32, 4, 2, 64


# ---------------- tiny RoBERTa (transformers 3.x semantics) ----------------
class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HID, padding_idx=PAD)
        self.position_embeddings = nn.Embedding(64, HID, padding_idx=PAD)
        self.token_type_embeddings = nn.Embedding(1, HID)
        self.LayerNorm = nn.LayerNorm(HID, eps=1e-5)

    def forward(self, inputs_embeds, position_ids):
        tt = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long)
        e = inputs_embeds + self.position_embeddings(position_ids) + self.token_type_embeddings(tt)
        return self.LayerNorm(e)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(HID, HID)
        self.k = nn.Linear(HID, HID)
        self.v = nn.Linear(HID, HID)
        self.o = nn.Linear(HID, HID)
        self.ln1 = nn.LayerNorm(HID, eps=1e-5)
        self.ff1 = nn.Linear(HID, FF)
        self.ff2 = nn.Linear(FF, HID)
        self.ln2 = nn.LayerNorm(HID, eps=1e-5)

    def split(self, x):
        B, L, _ = x.shape
        return x.view(B, L, HEADS, HID // HEADS).permute(0, 2, 1, 3)

    def forward(self, h, ext_mask):
        q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
        scores = q @ k.transpose(-1, -2) / math.sqrt(HID // HEADS)
        scores = scores + ext_mask                      # (B, 1, L, L) additive
        probs = scores.softmax(-1)
        ctx = (probs @ v).permute(0, 2, 1, 3).reshape(h.shape)
        h = self.ln1(h + self.o(ctx))
        return self.ln2(h + self.ff2(torch.nn.functional.gelu(self.ff1(h))))


class Roberta(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = Embeddings()
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.pooler = nn.Linear(HID, HID)

    def get_extended_attention_mask(self, attention_mask):
        if attention_mask.dim() == 3:
            ext = attention_mask[:, None, :, :]
        elif attention_mask.dim() == 2:
            ext = attention_mask[:, None, None, :]
        else:
            raise ValueError(attention_mask.shape)
        ext = ext.to(torch.float32)
        return (1.0 - ext) * -10000.0

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.embeddings.word_embeddings(input_ids)
        if position_ids is None:  # RoBERTa: create_position_ids_from_input_ids
            m = input_ids.ne(PAD).long()
            position_ids = torch.cumsum(m, 1) * m + PAD
        h = self.embeddings(inputs_embeds, position_ids)
        ext = self.get_extended_attention_mask(attention_mask)
        for layer in self.layers:
            h = layer(h, ext)
        pooled = torch.tanh(self.pooler(h[:, 0]))
        return h, pooled


# ---------------- GraphCodeBERT codesearch/model.py ----------------
class Model(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, code_inputs=None, attn_mask=None, position_idx=None, nl_inputs=None):
        if code_inputs is not None:
            nodes_mask = position_idx.eq(0)
            token_mask = position_idx.ge(2)
            inputs_embeddings = self.encoder.embeddings.word_embeddings(code_inputs)
            nodes_to_token_mask = nodes_mask[:, :, None] & token_mask[:, None, :] & attn_mask
            nodes_to_token_mask = nodes_to_token_mask / (nodes_to_token_mask.sum(-1) + 1e-10)[:, :, None]
            avg_embeddings = torch.einsum("abc,acd->abd", nodes_to_token_mask, inputs_embeddings)
            inputs_embeddings = inputs_embeddings * (~nodes_mask)[:, :, None] + avg_embeddings * nodes_mask[:, :, None]
            return self.encoder(inputs_embeds=inputs_embeddings, attention_mask=attn_mask, position_ids=position_idx)[1]
        else:
            return self.encoder(nl_inputs, attention_mask=nl_inputs.ne(1))[1]


# ---------------- run.py feature conversion (tokenizer/parser replaced by given data) ----------------
def convert(code_subtokens, dfg, code_length, data_flow_length):
    """code_subtokens: list of lists of ids (one list per original code token);
    dfg: list of (name_id, orig_token_index, [orig indices it comes from])."""
    ori2cur_pos = {-1: (0, 0)}
    for i in range(len(code_subtokens)):
        ori2cur_pos[i] = (ori2cur_pos[i - 1][1], ori2cur_pos[i - 1][1] + len(code_subtokens[i]))
    code_tokens = [y for x in code_subtokens for y in x]
    code_tokens = code_tokens[:code_length + data_flow_length - 2 - min(len(dfg), data_flow_length)]
    code_ids = [CLS] + code_tokens + [SEP]
    position_idx = [i + PAD + 1 for i in range(len(code_ids))]
    dfg = dfg[:code_length + data_flow_length - len(code_ids)]
    position_idx += [0 for _ in dfg]
    code_ids += [UNK for _ in dfg]
    padding_length = code_length + data_flow_length - len(code_ids)
    position_idx += [PAD] * padding_length
    code_ids += [PAD] * padding_length
    reverse_index = {x[1]: idx for idx, x in enumerate(dfg)}
    dfg = [x[:-1] + ([reverse_index[i] for i in x[-1] if i in reverse_index],) for x in dfg]
    dfg_to_dfg = [x[-1] for x in dfg]
    dfg_to_code = [ori2cur_pos[x[1]] for x in dfg]
    dfg_to_code = [(x[0] + 1, x[1] + 1) for x in dfg_to_code]
    return code_ids, position_idx, dfg_to_code, dfg_to_dfg


def build_attn_mask(code_ids, position_idx, dfg_to_code, dfg_to_dfg, total):
    attn_mask = np.zeros((total, total), dtype=bool)
    node_index = sum([i > 1 for i in position_idx])
    max_length = sum([i != 1 for i in position_idx])
    attn_mask[:node_index, :node_index] = True
    for idx, i in enumerate(code_ids):
        if i in [0, 2]:
            attn_mask[idx, :max_length] = True
    for idx, (a, b) in enumerate(dfg_to_code):
        if a < node_index and b < node_index:
            attn_mask[idx + node_index, a:b] = True
            attn_mask[a:b, idx + node_index] = True
    for idx, nodes in enumerate(dfg_to_dfg):
        for a in nodes:
            if a + node_index < len(position_idx):
                attn_mask[idx + node_index, a + node_index] = True
    return torch.tensor(attn_mask)


def reference_mask(code_ids, position_idx, dfg_to_code, dfg_to_dfg, total):
    """Independent: explicit relation over (kind, index) pairs, then a double loop."""
    kinds = ["code" if p >= 2 else ("node" if p == 0 else "pad") for p in position_idx]
    n_code = kinds.count("code")
    node_span = {}
    for j, (a, b) in enumerate(dfg_to_code):
        if a < n_code and b < n_code:
            node_span[n_code + j] = set(range(a, b))
    node_edges = {n_code + j: {n_code + a for a in nodes} for j, nodes in enumerate(dfg_to_dfg)}
    m = torch.zeros(total, total, dtype=torch.bool)
    for q in range(total):
        for k in range(total):
            if kinds[q] == "pad" or kinds[k] == "pad":
                ok = False
            elif code_ids[q] in (CLS, SEP) and kinds[q] == "code":
                ok = True
            elif kinds[q] == "code" and kinds[k] == "code":
                ok = True
            elif kinds[q] == "node" and kinds[k] == "code":
                ok = k in node_span.get(q, ())
            elif kinds[q] == "code" and kinds[k] == "node":
                ok = q in node_span.get(k, ())
            else:  # node -> node
                ok = k in node_edges.get(q, set())
            m[q, k] = ok
    return m


# ---------------- data: three "functions" with data flow ----------------
def rand_tokens(n):
    return [list(np.random.randint(4, VOCAB, size=np.random.randint(1, 3))) for _ in range(n)]

examples = [
    # x = a + b ; return x   (tokens 0..6)
    (rand_tokens(7), [(5, 0, [2, 4]), (6, 2, []), (7, 4, []), (8, 6, [0])]),
    # short one with a single edge
    (rand_tokens(4), [(9, 1, [3]), (10, 3, [])]),
    # longer one, a dfg node reading two others
    (rand_tokens(9), [(11, 0, []), (12, 3, [0, 5]), (13, 5, []), (14, 8, [3])]),
]
nl = [[CLS, 20, 21, 22, SEP], [CLS, 23, SEP], [CLS, 24, 25, 26, 27, SEP]]

CODE_LEN, DF_LEN = 24, 6
model = Model(Roberta()).eval()

feats = [convert(c, d, CODE_LEN, DF_LEN) for c, d in examples]
T = CODE_LEN + DF_LEN
code_inputs = torch.tensor([f[0] for f in feats])
position_idx = torch.tensor([f[1] for f in feats])
attn_mask = torch.stack([build_attn_mask(*f, T) for f in feats])
nl_len = max(len(x) for x in nl) + 2
nl_inputs = torch.tensor([x + [PAD] * (nl_len - len(x)) for x in nl])

ok = True
# 1) mask equals the independent relation
for b, f in enumerate(feats):
    same = torch.equal(attn_mask[b], reference_mask(*f, T))
    ok &= same
print("mask matches explicit graph relation:", ok)

with torch.no_grad():
    code_vec = model(code_inputs=code_inputs, attn_mask=attn_mask, position_idx=position_idx)
    nl_vec = model(nl_inputs=nl_inputs)
    scores = torch.einsum("ab,cb->ac", nl_vec, code_vec)
    loss = nn.CrossEntropyLoss()(scores, torch.arange(code_inputs.size(0)))

    # 2) each example alone, with no padding at all (length = its own code + dfg)
    for b, (c, d) in enumerate(examples):
        n_real = int(position_idx[b].ne(PAD).sum())
        # choose code_length/data_flow_length so nothing is truncated and nothing is padded
        n_code = int(position_idx[b].ge(2).sum())
        f1 = convert(c, d, n_code, n_real - n_code)
        assert PAD not in f1[1]
        m1 = build_attn_mask(*f1, n_real)[None]
        v1 = model(code_inputs=torch.tensor([f1[0]]), attn_mask=m1, position_idx=torch.tensor([f1[1]]))
        n1 = model(nl_inputs=torch.tensor([nl[b]]))
        ok &= torch.allclose(v1[0], code_vec[b], atol=1e-5)
        ok &= torch.allclose(n1[0], nl_vec[b], atol=1e-5)
    print("padded batch code/nl vectors match each example alone unpadded:", ok)

    # 3) dfg node input embeddings vs a loop averaging the node's code sub-tokens
    emb = model.encoder.embeddings.word_embeddings
    for b, f in enumerate(feats):
        n_code = sum(p >= 2 for p in f[1])
        for j, (a, e) in enumerate(f[2]):
            want = emb(code_inputs[b, a:e]).mean(0)
            nodes_mask = position_idx[b].eq(0)
            tok = position_idx[b].ge(2)
            w = (nodes_mask[:, None] & tok[None, :] & attn_mask[b]).float()
            w = w / (w.sum(-1) + 1e-10)[:, None]
            got = (w @ emb(code_inputs[b]))[n_code + j]
            ok &= torch.allclose(got, want, atol=1e-6)
    print("dfg node embeddings match loop average:", ok)

    # 4) loss vs the same scores from the unpadded singles
    v_single = torch.stack([
        model(code_inputs=torch.tensor([convert(c, d, int(position_idx[b].ge(2).sum()),
                                                 int(position_idx[b].eq(0).sum()))[0]]),
              attn_mask=build_attn_mask(*convert(c, d, int(position_idx[b].ge(2).sum()),
                                                  int(position_idx[b].eq(0).sum())),
                                        int(position_idx[b].ne(PAD).sum()))[None],
              position_idx=torch.tensor([convert(c, d, int(position_idx[b].ge(2).sum()),
                                                  int(position_idx[b].eq(0).sum()))[1]]))[0]
        for b, (c, d) in enumerate(examples)])
    n_single = torch.stack([model(nl_inputs=torch.tensor([x]))[0] for x in nl])
    loss1 = nn.CrossEntropyLoss()(torch.einsum("ab,cb->ac", n_single, v_single), torch.arange(3))
    ok &= torch.allclose(loss, loss1, atol=1e-5)
print("contrastive loss matches:", ok, float(loss))
print("MATCH" if ok else "MISMATCH")
assert ok
