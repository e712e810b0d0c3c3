# Citation: deepmedicine/BEHRT model/MLM.py (BertEmbeddings with age/segment/position ids, BertModel.forward
#   building extended_attention_mask) on pytorch_pretrained_bert's BertSelfAttention.
# Patient histories (diagnosis codes grouped in visits with SEP tokens) are right-padded; attention_mask is 0/1 ints
# (1 = real token), turned into an additive float mask (1.0 - mask) * -10000.0 broadcast over heads and queries and
# added to the scaled scores. Padded keys are suppressed; every row has real keys (CLS is always present).
import math
import torch
from torch import nn

torch.manual_seed(0)


class BertConfig:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.segment_embeddings = nn.Embedding(config.seg_vocab_size, config.hidden_size)
        self.age_embeddings = nn.Embedding(config.age_vocab_size, config.hidden_size)
        self.posi_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, word_ids, age_ids=None, seg_ids=None, posi_ids=None, age=True):
        word_embed = self.word_embeddings(word_ids)
        segment_embed = self.segment_embeddings(seg_ids)
        age_embed = self.age_embeddings(age_ids)
        posi_embeddings = self.posi_embeddings(posi_ids)
        if age:
            embeddings = word_embed + segment_embed + age_embed + posi_embeddings
        else:
            embeddings = word_embed + segment_embed + posi_embeddings
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(*context_layer.size()[:-2] + (self.all_head_size,))


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertSelfAttention(config)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.intermediate = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                          nn.Linear(config.intermediate_size, config.hidden_size))
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=1e-12)

    def forward(self, hidden_states, attention_mask):
        attention_output = self.ln1(self.dense(self.attention(hidden_states, attention_mask)) + hidden_states)
        return self.ln2(self.intermediate(attention_output) + attention_output)


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, input_ids, age_ids=None, seg_ids=None, posi_ids=None, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if age_ids is None:
            age_ids = torch.zeros_like(input_ids)
        if seg_ids is None:
            seg_ids = torch.zeros_like(input_ids)
        if posi_ids is None:
            posi_ids = torch.zeros_like(input_ids)
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        extended_attention_mask = extended_attention_mask.to(dtype=next(self.parameters()).dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        hidden = self.embeddings(input_ids, age_ids, seg_ids, posi_ids)
        for layer in self.encoder:
            hidden = layer(hidden, extended_attention_mask)
        return hidden


class BertForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.bert = BertModel(config)
        self.cls = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, age_ids=None, seg_ids=None, posi_ids=None, attention_mask=None, masked_lm_labels=None):
        sequence_output = self.bert(input_ids, age_ids, seg_ids, posi_ids, attention_mask)
        prediction_scores = self.cls(sequence_output)
        loss_fct = nn.CrossEntropyLoss(ignore_index=-1)
        return loss_fct(prediction_scores.view(-1, prediction_scores.size(-1)), masked_lm_labels.view(-1))


config = BertConfig(vocab_size=40, seg_vocab_size=2, age_vocab_size=100, max_position_embeddings=20, hidden_size=32,
                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.1,
                    attention_probs_dropout_prob=0.1)
PAD, CLS, SEP, MASK = 0, 1, 2, 3
# patients: visits of codes, CLS first, SEP after each visit; dataLoader/MLM.py seg alternates per visit, posi = visit idx
visits = [[[5, 6], [7], [8, 9, 10]], [[11, 12]], [[13], [14, 15]]]
max_len = 12
tokens, ages, segs, posis, masks, labels = [], [], [], [], [], []
for p, pv in enumerate(visits):
    tok, age, seg, pos = [CLS], [40 + p], [0], [0]
    for v, codes in enumerate(pv):
        tok += codes + [SEP]
        age += [40 + p + v] * (len(codes) + 1)
        seg += [v % 2] * (len(codes) + 1)
        pos += [v + 1] * (len(codes) + 1)
    lab = [-1] * len(tok)
    for j in range(1, len(tok)):
        if tok[j] > MASK and torch.rand(()) < 0.3:
            lab[j], tok[j] = tok[j], MASK
    n = len(tok)
    pad = max_len - n
    tokens.append(tok + [PAD] * pad)
    ages.append(age + [0] * pad)
    segs.append(seg + [0] * pad)
    posis.append(pos + [0] * pad)
    masks.append([1] * n + [0] * pad)
    labels.append(lab + [-1] * pad)
labels = torch.tensor(labels)
labels[0, 1] = 5  # ensure one target
model = BertForMaskedLM(config)
opt = torch.optim.Adam(model.parameters(), lr=3e-5)
model.train()
loss = model(torch.tensor(tokens), torch.tensor(ages), torch.tensor(segs), torch.tensor(posis),
             attention_mask=torch.tensor(masks), masked_lm_labels=labels)
loss.backward()
opt.step()
print("behrt mlm loss %.4f" % loss.item())
