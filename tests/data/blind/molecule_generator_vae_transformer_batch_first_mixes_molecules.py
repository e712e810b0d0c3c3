"""SMILES Beta-TCVAE whose Transformer attends across the batch instead of along the molecule.

Citation: DaoyuanLi2816/Molecule-Generator#22 ("Use batch_first attention and mask padding in the
Transformer", merged 2026-06-07). The buggy code is VAE.py at beb95a5 (class BetaTCVAE), read from the
repository; the fixed lines follow the PR description (I could read the description, not its diff).

Bug: ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` were built with the default
``batch_first=False`` while the model feeds them ``(batch, seq, embed)`` tensors from ``nn.Embedding``.
PyTorch therefore treats the batch axis as the sequence axis: self-attention mixes different molecules
of the batch, and each atom position is its own "batch element". Padding (``<pad>`` = 4, right-padded by
SimpleTokenizer) was never masked either.

Fix (per the PR): ``batch_first=True`` on both layers, and ``pad_mask = (x == pad_idx)`` passed as
``src_key_padding_mask``, ``tgt_key_padding_mask`` and ``memory_key_padding_mask``.

This program builds the model as VAE.py does (small sizes), tokenizes three SMILES of different lengths
with the project's SimpleTokenizer to max_len 8 and runs one forward pass in eval mode.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


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
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(embedding_dim, nhead, hidden_dim, batch_first=FIXED),
            num_layers=num_layers)
        self.mu = nn.Linear(embedding_dim, latent_dim)
        self.log_var = nn.Linear(embedding_dim, latent_dim)

        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(embedding_dim, nhead, hidden_dim, batch_first=FIXED),
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
            pad_mask = x == self.pad_idx
            encoded = self.encoder(embedded, src_key_padding_mask=pad_mask)
        else:
            encoded = self.encoder(embedded)
        mu = self.mu(encoded)
        log_var = self.log_var(encoded)
        z = self.reparameterize(mu, log_var)

        if FIXED:
            decoded = self.decoder(z, encoded, tgt_key_padding_mask=pad_mask,
                                   memory_key_padding_mask=pad_mask)
        else:
            decoded = self.decoder(z, encoded)
        out = self.fc_out(decoded)

        return out, mu, log_var


def main():
    torch.manual_seed(0)
    tokenizer = SimpleTokenizer()
    max_len = 8
    smiles = ["CC(O)CO", "CCO", "C(C)(C)O"]
    x = torch.stack([tokenizer.tokenize(s, max_len) for s in smiles])
    # latent_dim equals embedding_dim: z is the decoder's target sequence, as in VAE.py.
    model = BetaTCVAE(vocab_size=5, embedding_dim=16, hidden_dim=32, latent_dim=16, nhead=2,
                      num_layers=1, pad_idx=tokenizer.pad_idx, device="cpu")
    model.train()  # the project's train() loop
    out, mu, log_var = model(x)
    print("logits", tuple(out.shape), "first molecule argmax", out[0].argmax(-1).tolist())


if __name__ == "__main__":
    main()
