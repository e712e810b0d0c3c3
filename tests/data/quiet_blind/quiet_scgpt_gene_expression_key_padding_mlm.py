# Citation: bowang-lab/scGPT scgpt/model/model.py (TransformerModel, GeneEncoder, ContinuousValueEncoder, _encode,
#   ExprDecoder) and the fine-tuning loop in tutorials/Tutorial_Annotation.ipynb / examples (src_key_padding_mask =
#   input_gene_ids.eq(vocab[pad_token])).
# Masking: each cell is a variable-length set of expressed genes with a <cls> token first, padded with <pad> gene ids
#   (pad_value -2 for expression); the bool src_key_padding_mask (True = pad) of nn.TransformerEncoder blocks padded
#   genes as keys; bidirectional attention among real genes; masked-value (MLM) loss only on masked real positions.
import torch
import torch.nn as nn

torch.manual_seed(0)


class GeneEncoder(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, padding_idx=None):
        super().__init__()
        self.embedding = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.enc_norm = nn.LayerNorm(embedding_dim)

    def forward(self, x):
        return self.enc_norm(self.embedding(x))


class ContinuousValueEncoder(nn.Module):
    def __init__(self, d_model, dropout=0.0, max_value=512):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        self.linear1 = nn.Linear(1, d_model)
        self.activation = nn.ReLU()
        self.linear2 = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.max_value = max_value

    def forward(self, x):
        x = x.unsqueeze(-1)
        x = torch.clamp(x, max=self.max_value)
        x = self.activation(self.linear1(x))
        x = self.linear2(x)
        x = self.norm(x)
        return self.dropout(x)


class ExprDecoder(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(d_model, d_model), nn.LeakyReLU(), nn.Linear(d_model, d_model),
                                nn.LeakyReLU(), nn.Linear(d_model, 1))

    def forward(self, x):
        return dict(pred=self.fc(x).squeeze(-1))


class TransformerModel(nn.Module):
    def __init__(self, ntoken, d_model, nhead, d_hid, nlayers, vocab, pad_token="<pad>", dropout=0.0):
        super().__init__()
        self.encoder = GeneEncoder(ntoken, d_model, padding_idx=vocab[pad_token])
        self.value_encoder = ContinuousValueEncoder(d_model, dropout)
        encoder_layers = nn.TransformerEncoderLayer(d_model, nhead, d_hid, dropout, batch_first=True)
        self.transformer_encoder = nn.TransformerEncoder(encoder_layers, nlayers)
        self.decoder = ExprDecoder(d_model)

    def _encode(self, src, values, src_key_padding_mask):
        src = self.encoder(src)
        self.cur_gene_token_embs = src
        values = self.value_encoder(values)
        total_embs = src + values
        output = self.transformer_encoder(total_embs, src_key_padding_mask=src_key_padding_mask)
        return output

    def forward(self, src, values, src_key_padding_mask):
        transformer_output = self._encode(src, values, src_key_padding_mask)
        output = {}
        mlm_output = self.decoder(transformer_output)
        output["mlm_output"] = mlm_output["pred"]
        output["cell_emb"] = transformer_output[:, 0, :]
        return output


def masked_mse_loss(input, target, mask):
    mask = mask.float()
    loss = nn.functional.mse_loss(input * mask, target * mask, reduction="sum")
    return loss / mask.sum()


vocab = {"<pad>": 0, "<cls>": 1, **{f"G{i}": i + 2 for i in range(60)}}
pad_token, pad_value, mask_value = "<pad>", -2, -1
model = TransformerModel(len(vocab), 32, 4, 64, 2, vocab)
opt = torch.optim.Adam(model.parameters(), lr=1e-4)

n_genes = [20, 11, 6, 15]
L = max(n_genes) + 1
input_gene_ids = torch.full((4, L), vocab[pad_token])
target_values = torch.full((4, L), float(pad_value))
for i, n in enumerate(n_genes):
    input_gene_ids[i, 0] = vocab["<cls>"]
    target_values[i, 0] = 0.0
    input_gene_ids[i, 1:n + 1] = torch.randperm(60)[:n] + 2
    target_values[i, 1:n + 1] = torch.randint(1, 51, (n,)).float()
input_values = target_values.clone()
real = input_gene_ids.ne(vocab[pad_token]) & input_gene_ids.ne(vocab["<cls>"])
to_mask = (torch.rand(4, L) < 0.4) & real
input_values[to_mask] = mask_value

src_key_padding_mask = input_gene_ids.eq(vocab[pad_token])
output_dict = model(input_gene_ids, input_values, src_key_padding_mask=src_key_padding_mask)
masked_positions = input_values.eq(mask_value)
loss = masked_mse_loss(output_dict["mlm_output"], target_values, masked_positions)
opt.zero_grad()
loss.backward()
opt.step()
print(f"mse {loss.item():.4f} cell_emb {output_dict['cell_emb'].norm().item():.4f}")
