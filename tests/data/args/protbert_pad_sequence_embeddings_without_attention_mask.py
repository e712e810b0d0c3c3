# The Ankh feature-extraction bug (agemagician/Ankh#24: a padded batch of proteins embedded without its attention_mask)
# written another way: a ProtBert-style BERT protein encoder, the residues tokenized one by one and batched with
# torch.nn.utils.rnn.pad_sequence(padding_value=pad id), the model called positionally with the ids alone, per-protein
# embeddings then mean-pooled over each protein's own residues. Buggy: no attention_mask, so every residue attends the
# [PAD] positions of the shorter proteins; fixed: the mask built from the lengths is handed to the model.
import sys

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, CLS, SEP = 0, 2, 3
AMINO = "LAGVESIKRDTPNQFYMHCWXUBZO"
vocab = {a: i + 5 for i, a in enumerate(AMINO)}

config = BertConfig(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=64, pad_token_id=PAD, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
model = BertModel(config, add_pooling_layer=False).eval()

proteins = ["MKTAYIAKQRQISFVKSHFSRQ", "GSHMSLFDF", "MVLSPADKTNVKAAW"]
encoded = [torch.tensor([CLS] + [vocab[a] for a in p] + [SEP]) for p in proteins]
lengths = torch.tensor([len(e) for e in encoded])
batch = pad_sequence(encoded, batch_first=True, padding_value=PAD)

with torch.no_grad():
    if FIXED:
        mask = (torch.arange(batch.shape[1])[None, :] < lengths[:, None]).long()
        hidden = model(batch, attention_mask=mask).last_hidden_state
    else:
        hidden = model(batch).last_hidden_state
    alone = model(encoded[1][None]).last_hidden_state

per_protein = [hidden[i, 1:n - 1].mean(0) for i, n in enumerate(lengths.tolist())]
diff = (per_protein[1] - alone[0, 1:-1].mean(0)).abs().max().item()
print(f"fixed={FIXED} max |embedding(protein 1, padded batch) - alone| = {diff:.6f}")
