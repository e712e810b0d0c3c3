# Citation: sunlabuiuc/PyHealth#140 ("fix mask create bug"), commit 0ec37e4 (+ typo fix), merged as 4b328c1.
# Upstream: pyhealth/models/transformer.py, Transformer.forward (cases 1 and 2: code inputs) feeding
#   TransformerLayer.forward -> TransformerBlock -> MultiHeadedAttention / PositionwiseFeedForward.
#   (The same line was changed in rnn.py, mlp.py, tcn.py, adacare.py, agent.py, concare.py, grasp.py, stagenet.py.)
# Bug: the padding mask was derived from the embedded codes as `torch.sum(x, dim=2) != 0`: a real
#   code (or visit) whose embedding entries sum to exactly 0 is taken for padding, so it is hidden
#   from attention and its feed-forward output is zeroed.
# Fix: `mask = torch.any(x != 0, dim=2)` (only the all-zero padding_idx embedding is padding).
import math
import sys
from typing import List, Optional, Tuple

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


# ---- pyhealth/tokenizer.py (Vocabulary / Tokenizer, shrunk) ----
class Tokenizer:
    def __init__(self, tokens: List[str], special_tokens: Optional[List[str]] = None):
        special_tokens = special_tokens or []
        self.idx2token = {}
        self.token2idx = {}
        for t in special_tokens + sorted(set(tokens)):
            if t not in self.token2idx:
                self.token2idx[t] = len(self.token2idx)
                self.idx2token[self.token2idx[t]] = t

    def get_padding_index(self):
        return self.token2idx["<pad>"]

    def get_vocabulary_size(self):
        return len(self.token2idx)

    def convert_tokens_to_indices(self, tokens):
        return [self.token2idx.get(t, self.token2idx["<unk>"]) for t in tokens]

    def batch_encode_2d(self, batch, padding=True, truncation=True, max_length=512):
        if truncation:
            batch = [tokens[-max_length:] for tokens in batch]
        if padding:
            batch_max_length = max([len(tokens) for tokens in batch])
            batch = [tokens + ["<pad>"] * (batch_max_length - len(tokens)) for tokens in batch]
        return [[self.token2idx.get(t, 1) for t in tokens] for tokens in batch]

    def batch_encode_3d(self, batch, padding=(True, True), truncation=(True, True), max_length=(10, 512)):
        if truncation[0]:
            batch = [tokens[-max_length[0]:] for tokens in batch]
        if truncation[1]:
            batch = [[tokens[-max_length[1]:] for tokens in visits] for visits in batch]
        if padding[0]:
            batch_max_length = max([len(tokens) for tokens in batch])
            batch = [tokens + [["<pad>"]] * (batch_max_length - len(tokens)) for tokens in batch]
        if padding[1]:
            batch_max_length = max([max([len(tokens) for tokens in visits]) for visits in batch])
            batch = [[tokens + ["<pad>"] * (batch_max_length - len(tokens)) for tokens in visits]
                     for visits in batch]
        return [[[self.token2idx.get(t, 1) for t in tokens] for tokens in visits] for visits in batch]


# ---- pyhealth/models/transformer.py ----
class Attention(nn.Module):
    def forward(self, query, key, value, mask=None, dropout=None):
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(query.size(-1))
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        p_attn = torch.softmax(scores, dim=-1)
        if mask is not None:
            p_attn = p_attn.masked_fill(mask == 0, 0)
        if dropout is not None:
            p_attn = dropout(p_attn)
        return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.linear_layers = nn.ModuleList([nn.Linear(d_model, d_model, bias=False) for _ in range(3)])
        self.output_linear = nn.Linear(d_model, d_model, bias=False)
        self.attention = Attention()
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        batch_size = query.size(0)
        query, key, value = [
            l(x).view(batch_size, -1, self.h, self.d_k).transpose(1, 2)
            for l, x in zip(self.linear_layers, (query, key, value))
        ]
        if mask is not None:
            mask = mask.unsqueeze(1)
        x, attn = self.attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(batch_size, -1, self.h * self.d_k)
        return self.output_linear(x)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = nn.GELU()

    def forward(self, x, mask=None):
        x = self.w_2(self.dropout(self.activation(self.w_1(x))))
        if mask is not None:
            mask = mask.sum(dim=-1) > 0
            x[~mask] = 0
        return x


class SublayerConnection(nn.Module):
    def __init__(self, size, dropout):
        super().__init__()
        self.norm = nn.LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class TransformerBlock(nn.Module):
    def __init__(self, hidden, attn_heads, dropout):
        super().__init__()
        self.attention = MultiHeadedAttention(h=attn_heads, d_model=hidden)
        self.feed_forward = PositionwiseFeedForward(d_model=hidden, d_ff=4 * hidden, dropout=dropout)
        self.input_sublayer = SublayerConnection(size=hidden, dropout=dropout)
        self.output_sublayer = SublayerConnection(size=hidden, dropout=dropout)
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, x, mask=None):
        x = self.input_sublayer(x, lambda _x: self.attention(_x, _x, _x, mask=mask))
        x = self.output_sublayer(x, lambda _x: self.feed_forward(_x, mask=mask))
        return self.dropout(x)


class TransformerLayer(nn.Module):
    def __init__(self, feature_size, heads=1, dropout=0.5, num_layers=1):
        super().__init__()
        self.transformer = nn.ModuleList(
            [TransformerBlock(feature_size, heads, dropout) for _ in range(num_layers)])

    def forward(self, x: torch.tensor, mask: Optional[torch.tensor] = None) -> Tuple[torch.tensor, torch.tensor]:
        if mask is not None:
            mask = torch.einsum("ab,ac->abc", mask, mask)
        for transformer in self.transformer:
            x = transformer(x, mask)
        emb = x
        cls_emb = x[:, 0, :]
        return emb, cls_emb


class Transformer(nn.Module):
    """pyhealth.models.Transformer (BaseModel plumbing inlined), binary mode."""

    def __init__(self, input_info, all_tokens, feature_keys, embedding_dim=128, **kwargs):
        super().__init__()
        self.input_info = input_info
        self.feature_keys = feature_keys
        self.embedding_dim = embedding_dim
        self.feat_tokenizers = {}
        self.embeddings = nn.ModuleDict()
        for feature_key in feature_keys:
            # BaseModel.add_feature_transform_layer (str inputs)
            tokenizer = Tokenizer(tokens=all_tokens[feature_key], special_tokens=["<pad>", "<unk>"])
            self.feat_tokenizers[feature_key] = tokenizer
            self.embeddings[feature_key] = nn.Embedding(
                tokenizer.get_vocabulary_size(), self.embedding_dim,
                padding_idx=tokenizer.get_padding_index())
        self.transformer = nn.ModuleDict()
        for feature_key in feature_keys:
            self.transformer[feature_key] = TransformerLayer(feature_size=embedding_dim, **kwargs)
        self.fc = nn.Linear(len(self.feature_keys) * self.embedding_dim, 1)
        self.device = torch.device("cpu")

    def forward(self, **kwargs):
        patient_emb = []
        for feature_key in self.feature_keys:
            dim_, type_ = self.input_info[feature_key]["dim"], self.input_info[feature_key]["type"]
            # for case 1: [code1, code2, code3, ...]
            if (dim_ == 2) and (type_ == str):
                x = self.feat_tokenizers[feature_key].batch_encode_2d(kwargs[feature_key])
                x = torch.tensor(x, dtype=torch.long, device=self.device)
                # (patient, event, embedding_dim)
                x = self.embeddings[feature_key](x)
                # (patient, event)
                if FIXED:
                    mask = torch.any(x != 0, dim=2)
                else:
                    mask = torch.sum(x, dim=2) != 0
            # for case 2: [[code1, code2], [code3, ...], ...]
            elif (dim_ == 3) and (type_ == str):
                x = self.feat_tokenizers[feature_key].batch_encode_3d(kwargs[feature_key])
                x = torch.tensor(x, dtype=torch.long, device=self.device)
                # (patient, visit, event, embedding_dim)
                x = self.embeddings[feature_key](x)
                # (patient, visit, embedding_dim)
                x = torch.sum(x, dim=2)
                # (patient, visit)
                if FIXED:
                    mask = torch.any(x != 0, dim=2)
                else:
                    mask = torch.sum(x, dim=2) != 0
            else:
                raise NotImplementedError
            _, x = self.transformer[feature_key](x, mask)
            patient_emb.append(x)
        patient_emb = torch.cat(patient_emb, dim=1)
        logits = self.fc(patient_emb)
        y_true = torch.tensor(kwargs["label"], dtype=torch.float32).unsqueeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, y_true)
        y_prob = torch.sigmoid(logits)
        return {"loss": loss, "y_prob": y_prob, "y_true": y_true, "logit": logits}


def main():
    torch.manual_seed(0)
    # a batch of 3 patients: event-level procedure codes (case 1) and visit-level ICD codes (case 2)
    batch = {
        "procedures": [
            ["P01", "P02", "P03", "P04", "P05"],
            ["P06", "P07", "P08"],
            ["P09", "P10"],
        ],
        "conditions": [
            [["C01", "C02"], ["C03"], ["C04", "C05", "C06"]],
            [["C07", "C08", "C09"], ["C10"]],
            [["C11"], ["C12", "C01"], ["C02"], ["C05"]],
        ],
        "label": [1, 0, 1],
    }
    input_info = {"procedures": {"dim": 2, "type": str}, "conditions": {"dim": 3, "type": str}}
    all_tokens = {
        "procedures": [c for p in batch["procedures"] for c in p],
        "conditions": [c for p in batch["conditions"] for v in p for c in v],
    }
    model = Transformer(input_info, all_tokens, ["procedures", "conditions"],
                        embedding_dim=8, heads=2, dropout=0.5, num_layers=2)
    # embedding tables restored from a checkpoint stored with 4-bit quantized weights (step 0.5)
    with torch.no_grad():
        for emb in model.embeddings.values():
            emb.weight.copy_(torch.round(emb.weight * 2) / 2)
            emb.weight[emb.padding_idx].zero_()
    model.eval()
    with torch.no_grad():
        ret = model(**batch)
    print("mode:", "fixed" if FIXED else "buggy")
    print("logit:", [round(v, 5) for v in ret["logit"].view(-1).tolist()])
    print("y_prob:", [round(v, 5) for v in ret["y_prob"].view(-1).tolist()])
    print("loss:", round(ret["loss"].item(), 6))


if __name__ == "__main__":
    main()
