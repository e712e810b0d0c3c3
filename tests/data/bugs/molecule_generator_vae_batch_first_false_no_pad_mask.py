"""Molecule-Generator BetaTCVAE: Transformer layers built batch_first=False, fed (batch, seq, embed); pads unmasked.

Citation: DaoyuanLi2816/Molecule-Generator PR #22 ("Use batch_first attention and mask padding in the
Transformer", merged). Pre-fix source read (VAE.py: SimpleTokenizer, BetaTCVAE); the fix is written from the
PR description (the fixed diff itself was not read).

Bug: `nn.TransformerEncoderLayer(embedding_dim, nhead, hidden_dim)` / `nn.TransformerDecoderLayer(...)` keep
the default batch_first=False, but `forward` hands them `self.embedding(x)` of shape (batch, seq, embed). The
layers therefore attend along the batch axis: each SMILES position attends to the same position of the other
molecules in the batch, and never to the other tokens of its own molecule. Besides, `<pad>` (pad_idx) was never
masked, so real tokens attend to padding.

Fix (as described in the PR): batch_first=True on both layers; `pad_mask = (x == pad_idx)` passed as
src_key_padding_mask, tgt_key_padding_mask and memory_key_padding_mask.

This program tokenizes three SMILES of different lengths with the project's SimpleTokenizer (right-padded with
pad_idx = 4 to the longest), runs BetaTCVAE.forward as `test()` does (eval, no_grad) and prints the output shape.
"""
import sys
import warnings

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
warnings.filterwarnings("ignore")


class SimpleTokenizer:
    def __init__(self):
        self.char_to_idx = {'C': 0, 'O': 1, '(': 2, ')': 3, '<pad>': 4}
        self.idx_to_char = {v: k for k, v in self.char_to_idx.items()}
        self.pad_idx = self.char_to_idx['<pad>']

    def tokenize(self, smiles, max_len):
        tokenized_smiles = [self.char_to_idx[char] for char in smiles]
        tokenized_smiles += [self.pad_idx] * (max_len - len(tokenized_smiles))
        return torch.tensor(tokenized_smiles, dtype=torch.long)


class BetaTCVAE(nn.Module):
    def __init__(self, vocab_size, embedding_dim, hidden_dim, latent_dim, nhead, num_layers, pad_idx, device):
        super(BetaTCVAE, self).__init__()

        self.pad_idx = pad_idx
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=pad_idx)
        if FIXED:
            self.encoder = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(embedding_dim, nhead, hidden_dim, batch_first=True),
                num_layers=num_layers)
        else:
            self.encoder = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(embedding_dim, nhead, hidden_dim),
                num_layers=num_layers)
        self.mu = nn.Linear(embedding_dim, latent_dim)
        self.log_var = nn.Linear(embedding_dim, latent_dim)

        if FIXED:
            self.decoder = nn.TransformerDecoder(
                nn.TransformerDecoderLayer(embedding_dim, nhead, hidden_dim, batch_first=True),
                num_layers=num_layers)
        else:
            self.decoder = nn.TransformerDecoder(
                nn.TransformerDecoderLayer(embedding_dim, nhead, hidden_dim),
                num_layers=num_layers)
        self.fc_out = nn.Linear(embedding_dim, vocab_size)

        self.device = device

    def reparameterize(self, mu, log_var):
        std = torch.exp(0.5 * log_var)
        eps = torch.randn_like(std).to(self.device)
        return mu + eps * std

    def forward(self, x):
        embedded = self.embedding(x)
        if FIXED:
            pad_mask = (x == self.pad_idx)
            encoded = self.encoder(embedded, src_key_padding_mask=pad_mask)
        else:
            encoded = self.encoder(embedded)
        mu = self.mu(encoded)
        log_var = self.log_var(encoded)
        z = self.reparameterize(mu, log_var)

        if FIXED:
            decoded = self.decoder(z, encoded, tgt_key_padding_mask=pad_mask, memory_key_padding_mask=pad_mask)
        else:
            decoded = self.decoder(z, encoded)
        out = self.fc_out(decoded)

        return out, mu, log_var


if __name__ == "__main__":
    torch.manual_seed(0)
    simple_tokenizer = SimpleTokenizer()
    smiles_list = ["CC(O)C", "CCO", "C(C)O"]
    max_len = max(len(smiles) for smiles in smiles_list)
    x = torch.stack([simple_tokenizer.tokenize(s, max_len) for s in smiles_list])

    vocab_size = 6
    embedding_dim = 16
    hidden_dim = 64
    latent_dim = 16
    nhead = 4
    num_layers = 2
    pad_idx = 4
    device = torch.device('cpu')

    model = BetaTCVAE(vocab_size, embedding_dim, hidden_dim, latent_dim, nhead, num_layers, pad_idx, device)
    model.eval()
    with torch.no_grad():
        recon_x, mu, log_var = model(x)
    print("fixed" if FIXED else "buggy", tuple(recon_x.shape), f"{recon_x[1, 0].sum().item():.4f}")
