# Citation: facebookresearch/fairseq fairseq/models/roberta/model.py @b3fa5100c65a9e3a89f2f60f91c795309aefbfba
#   (+ fairseq/models/transformer/transformer_encoder.py, fairseq/modules/multihead_attention.py, fairseq/utils.py make_positions)
# RoBERTa sentence classification on a RightPadDataset batch: encoder_padding_mask = src_tokens.eq(padding_idx)
# (True = pad), pads get position padding_idx via make_positions and zeroed embeddings, and every self-attention
# layer fills padded key columns of the (bsz*heads, tgt, src) weights with -inf. The head reads the <s> token.
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def make_positions(tensor, padding_idx: int, onnx_trace: bool = False):
    mask = tensor.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


class LearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, padding_idx):
        super().__init__(num_embeddings, embedding_dim, padding_idx)

    def forward(self, input):
        positions = make_positions(input, self.padding_idx)
        return F.embedding(positions, self.weight, self.padding_idx)


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = dropout

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        src_len = key.size(0)
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        assert list(attn_weights.size()) == [bsz * self.num_heads, tgt_len, src_len]
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        if key_padding_mask is not None:
            # don't attend to padding symbols
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_probs = F.dropout(attn_weights_float.type_as(attn_weights), p=self.dropout, training=self.training)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, self.embed_dim)
        return self.out_proj(attn), None


class TransformerEncoderLayer(nn.Module):
    def __init__(self, embed_dim, heads, ffn_dim):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, heads, dropout=0.1)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, encoder_padding_mask, attn_mask=None):
        residual = x
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask, need_weights=False,
                              attn_mask=attn_mask)
        x = self.self_attn_layer_norm(residual + x)  # post-norm (encoder_normalize_before=False)
        residual = x
        x = self.fc2(F.gelu(self.fc1(x)))
        return self.final_layer_norm(residual + x)


class TransformerEncoder(nn.Module):
    def __init__(self, vocab, padding_idx, embed_dim=32, layers=2, heads=4, max_positions=32):
        super().__init__()
        self.padding_idx = padding_idx
        self.embed_tokens = nn.Embedding(vocab, embed_dim, padding_idx)
        self.embed_scale = 1.0
        self.embed_positions = LearnedPositionalEmbedding(max_positions + padding_idx + 1, embed_dim, padding_idx)
        self.layernorm_embedding = nn.LayerNorm(embed_dim)
        self.layers = nn.ModuleList([TransformerEncoderLayer(embed_dim, heads, 64) for _ in range(layers)])

    def forward_embedding(self, src_tokens):
        token_embedding = self.embed_tokens(src_tokens)
        x = embed = self.embed_scale * token_embedding
        x = embed + self.embed_positions(src_tokens)
        x = self.layernorm_embedding(x)
        return x, embed

    def forward(self, src_tokens, src_lengths=None):
        # compute padding mask
        encoder_padding_mask = src_tokens.eq(self.padding_idx)
        has_pads = encoder_padding_mask.any()
        x, encoder_embedding = self.forward_embedding(src_tokens)
        # account for padding while computing the representation
        if has_pads:
            x = x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x))
        # B x T x C -> T x B x C
        x = x.transpose(0, 1)
        for layer in self.layers:
            x = layer(x, encoder_padding_mask=encoder_padding_mask if has_pads else None)
        return {"encoder_out": [x], "encoder_padding_mask": [encoder_padding_mask]}


class RobertaClassificationHead(nn.Module):
    def __init__(self, input_dim, inner_dim, num_classes, pooler_dropout=0.0):
        super().__init__()
        self.dense = nn.Linear(input_dim, inner_dim)
        self.dropout = nn.Dropout(p=pooler_dropout)
        self.out_proj = nn.Linear(inner_dim, num_classes)

    def forward(self, features, **kwargs):
        x = features[:, 0, :]  # take <s> token (equiv. to [CLS])
        x = self.dropout(x)
        x = torch.tanh(self.dense(x))
        x = self.dropout(x)
        return self.out_proj(x)


class RobertaModel(nn.Module):
    def __init__(self, vocab=40, padding_idx=1):
        super().__init__()
        self.encoder = TransformerEncoder(vocab, padding_idx)
        self.classification_heads = nn.ModuleDict({"sentence_classification_head": RobertaClassificationHead(32, 32, 2)})

    def forward(self, src_tokens, features_only=True, classification_head_name=None):
        x = self.encoder(src_tokens)["encoder_out"][0].transpose(0, 1)  # T x B x C -> B x T x C
        return self.classification_heads[classification_head_name](x)


BOS, PAD, EOS = 0, 1, 2
sents = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
samples = [[BOS] + s + [EOS] for s in sents]
T = max(len(s) for s in samples)
src_tokens = torch.full((3, T), PAD)
for i, s in enumerate(samples):  # RightPadDataset (left_pad=False)
    src_tokens[i, :len(s)] = torch.tensor(s)
targets = torch.tensor([1, 0, 1])
model = RobertaModel()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(3):  # SentencePredictionCriterion
    model.train()
    logits = model(src_tokens, classification_head_name="sentence_classification_head")
    loss = F.nll_loss(F.log_softmax(logits, dim=-1, dtype=torch.float32), targets, reduction="sum")
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
model.eval()
with torch.no_grad():
    batched = model(src_tokens, classification_head_name="sentence_classification_head")
    for i, s in enumerate(samples):
        single = model(torch.tensor([s]), classification_head_name="sentence_classification_head")
        assert torch.allclose(single[0], batched[i], atol=1e-5), i
print("padded batch == unpadded sentences")
