"""UvA DL tutorial 6 (Transformers and Multi-Head Attention): a per-example mask lands on the heads axis.

Citation: phlippe/uvadlc_notebooks commit ac42535 ("Tutorial 6: Supporting flexible mask shape"),
docs/tutorial_notebooks/tutorial6/Transformers_and_MHAttention.ipynb (the PyTorch notebook; the JAX
twin was reported in phlippe/uvadlc_notebooks#67).

Bug: `MultiheadAttention.forward` hands the `mask` it is given straight to `scaled_dot_product`,
where `attn_logits` is [Batch, Head, SeqLen, SeqLen] and `masked_fill(mask == 0, -9e15)` broadcasts
the mask from the right.  A per-example mask of shape [Batch, 1, SeqLen] (or [Batch, SeqLen, SeqLen])
is therefore aligned with [Head, SeqLen, SeqLen]: when the batch size equals the number of heads the
call goes through silently and head h of every example is masked with example h's padding.
Fix: `expand_mask(mask)` before the attention, which turns a 3D mask into [Batch, 1, SeqLen, SeqLen]
(broadcast over the heads) and a 2D one into [1, 1, SeqLen, SeqLen].

Reproduction: the notebook's TransformerPredictor (LightningModule reduced to nn.Module, no
optimizer/scheduler) run on a right-padded batch of 4 one-hot sequences with num_heads = 4.
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def scaled_dot_product(q, k, v, mask=None):
    d_k = q.size()[-1]
    attn_logits = torch.matmul(q, k.transpose(-2, -1))
    attn_logits = attn_logits / math.sqrt(d_k)
    if mask is not None:
        attn_logits = attn_logits.masked_fill(mask == 0, -9e15)
    attention = F.softmax(attn_logits, dim=-1)
    values = torch.matmul(attention, v)
    return values, attention


# Helper function to support different mask shapes.
# Output shape supports (batch_size, number of heads, seq length, seq length)
# If 2D: broadcasted over batch size and number of heads
# If 3D: broadcasted over number of heads
# If 4D: leave as is
def expand_mask(mask):
    assert mask.ndim > 2, "Mask must be at least 2-dimensional with seq_length x seq_length"
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    return mask


class MultiheadAttention(nn.Module):

    def __init__(self, input_dim, embed_dim, num_heads):
        super().__init__()
        assert embed_dim % num_heads == 0, "Embedding dimension must be 0 modulo number of heads."

        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads

        # Stack all weight matrices 1...h together for efficiency
        self.qkv_proj = nn.Linear(input_dim, 3 * embed_dim)
        self.o_proj = nn.Linear(embed_dim, embed_dim)

        self._reset_parameters()

    def _reset_parameters(self):
        # Original Transformer initialization, see PyTorch documentation
        nn.init.xavier_uniform_(self.qkv_proj.weight)
        self.qkv_proj.bias.data.fill_(0)
        nn.init.xavier_uniform_(self.o_proj.weight)
        self.o_proj.bias.data.fill_(0)

    def forward(self, x, mask=None, return_attention=False):
        batch_size, seq_length, _ = x.size()
        if FIXED and mask is not None:
            mask = expand_mask(mask)
        qkv = self.qkv_proj(x)

        # Separate Q, K, V from linear output
        qkv = qkv.reshape(batch_size, seq_length, self.num_heads, 3 * self.head_dim)
        qkv = qkv.permute(0, 2, 1, 3)  # [Batch, Head, SeqLen, Dims]
        q, k, v = qkv.chunk(3, dim=-1)

        # Determine value outputs
        values, attention = scaled_dot_product(q, k, v, mask=mask)
        values = values.permute(0, 2, 1, 3)  # [Batch, SeqLen, Head, Dims]
        values = values.reshape(batch_size, seq_length, self.embed_dim)
        o = self.o_proj(values)

        if return_attention:
            return o, attention
        else:
            return o


class EncoderBlock(nn.Module):

    def __init__(self, input_dim, num_heads, dim_feedforward, dropout=0.0):
        super().__init__()

        # Attention layer
        self.self_attn = MultiheadAttention(input_dim, input_dim, num_heads)

        # Two-layer MLP
        self.linear_net = nn.Sequential(
            nn.Linear(input_dim, dim_feedforward),
            nn.Dropout(dropout),
            nn.ReLU(inplace=True),
            nn.Linear(dim_feedforward, input_dim)
        )

        # Layers to apply in between the main layers
        self.norm1 = nn.LayerNorm(input_dim)
        self.norm2 = nn.LayerNorm(input_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        # Attention part
        attn_out = self.self_attn(x, mask=mask)
        x = x + self.dropout(attn_out)
        x = self.norm1(x)

        # MLP part
        linear_out = self.linear_net(x)
        x = x + self.dropout(linear_out)
        x = self.norm2(x)

        return x


class TransformerEncoder(nn.Module):

    def __init__(self, num_layers, **block_args):
        super().__init__()
        self.layers = nn.ModuleList([EncoderBlock(**block_args) for _ in range(num_layers)])

    def forward(self, x, mask=None):
        for l in self.layers:
            x = l(x, mask=mask)
        return x


class PositionalEncoding(nn.Module):

    def __init__(self, d_model, max_len=5000):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0)
        self.register_buffer('pe', pe, persistent=False)

    def forward(self, x):
        x = x + self.pe[:, :x.size(1)]
        return x


class TransformerPredictor(nn.Module):

    def __init__(self, input_dim, model_dim, num_classes, num_heads, num_layers, dropout=0.0, input_dropout=0.0):
        super().__init__()
        self.hparams = dict(input_dim=input_dim, model_dim=model_dim, num_classes=num_classes,
                            num_heads=num_heads, num_layers=num_layers, dropout=dropout,
                            input_dropout=input_dropout)
        self._create_model()

    def _create_model(self):
        hp = self.hparams
        # Input dim -> Model dim
        self.input_net = nn.Sequential(
            nn.Dropout(hp["input_dropout"]),
            nn.Linear(hp["input_dim"], hp["model_dim"])
        )
        # Positional encoding for sequences
        self.positional_encoding = PositionalEncoding(d_model=hp["model_dim"])
        # Transformer
        self.transformer = TransformerEncoder(num_layers=hp["num_layers"],
                                              input_dim=hp["model_dim"],
                                              dim_feedforward=2 * hp["model_dim"],
                                              num_heads=hp["num_heads"],
                                              dropout=hp["dropout"])
        # Output classifier per sequence element
        self.output_net = nn.Sequential(
            nn.Linear(hp["model_dim"], hp["model_dim"]),
            nn.LayerNorm(hp["model_dim"]),
            nn.ReLU(inplace=True),
            nn.Dropout(hp["dropout"]),
            nn.Linear(hp["model_dim"], hp["num_classes"])
        )

    def forward(self, x, mask=None, add_positional_encoding=True):
        x = self.input_net(x)
        if add_positional_encoding:
            x = self.positional_encoding(x)
        x = self.transformer(x, mask=mask)
        x = self.output_net(x)
        return x


def main():
    torch.manual_seed(42)
    num_categories = 10
    model = TransformerPredictor(input_dim=num_categories, model_dim=32, num_classes=num_categories,
                                 num_heads=4, num_layers=2, dropout=0.0, input_dropout=0.0)
    model.eval()

    # A right-padded batch of token sequences (pad with 0), as a sequence-to-sequence task would batch them.
    lengths = torch.tensor([6, 4, 5, 3])
    seq_len = int(lengths.max())
    inp_data = torch.randint(1, num_categories, (len(lengths), seq_len))
    valid = torch.arange(seq_len)[None, :] < lengths[:, None]          # [Batch, SeqLen]
    inp_data = inp_data.masked_fill(~valid, 0)
    mask = valid.unsqueeze(1)                                          # [Batch, 1, SeqLen]: keys each example may see

    x = F.one_hot(inp_data, num_classes=num_categories).float()
    with torch.no_grad():
        preds = model(x, mask=mask)

    for b in range(len(lengths)):
        n = int(lengths[b])
        print(f"seq {b} (len {n}) logits[0,:4] = {[round(v, 4) for v in preds[b, 0, :4].tolist()]}"
              f"  argmax = {preds[b, :n].argmax(-1).tolist()}")


if __name__ == "__main__":
    main()
