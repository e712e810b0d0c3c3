# Ankh protein language model (T5 encoder), agemagician/Ankh#24 (fixed by agemagician/Ankh commit 50f011f, PR #26).
# The feature-extraction example batch-encodes proteins with padding=True but calls
# model(input_ids=ids) without the tokenizer's attention_mask, so residues attend to <pad>.
import sys

import torch
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

AA = "ACDEFGHIKLMNPQRSTVWYX"


class AnkhTokenizer:
    """Stand-in for Ankh's per-residue T5 tokenizer: <pad>=0, </s>=1, <unk>=2, residues after."""

    pad_token_id = 0
    eos_token_id = 1

    def batch_encode_plus(self, batch, add_special_tokens=True, padding=True,
                          is_split_into_words=True, return_tensors="pt"):
        ids = [[3 + AA.index(a) for a in seq] + ([self.eos_token_id] if add_special_tokens else [])
               for seq in batch]
        L = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), L), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), L), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, :len(x)] = torch.tensor(x)
            attention_mask[i, :len(x)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def load_base_model():
    config = T5Config(vocab_size=3 + len(AA), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                      num_heads=4, relative_attention_num_buckets=16, dropout_rate=0.0,
                      feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                      initializer_factor=4.0)
    return T5EncoderModel(config), AnkhTokenizer()


model, tokenizer = load_base_model()
model.eval()

protein_sequences = ["MKALCLLLLPVLGLLVSSKTLCSMEEA", "GSHMSLFDFFKNK", "MEEAINERIQEVAGS"]
protein_sequences = [list(seq) for seq in protein_sequences]

if FIXED:
    outputs = tokenizer.batch_encode_plus(protein_sequences, add_special_tokens=True, padding=True,
                                          is_split_into_words=True, return_tensors="pt")
    with torch.no_grad():
        embeddings = model(input_ids=outputs["input_ids"], attention_mask=outputs["attention_mask"])
else:
    ids = tokenizer.batch_encode_plus(protein_sequences, add_special_tokens=True, padding=True,
                                      is_split_into_words=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        embeddings = model(input_ids=ids)

# reference: each protein embedded alone (no padding)
max_diff = 0.0
with torch.no_grad():
    for i, seq in enumerate(protein_sequences):
        one = tokenizer.batch_encode_plus([seq], add_special_tokens=True, padding=True,
                                          is_split_into_words=True, return_tensors="pt")
        alone = model(input_ids=one["input_ids"]).last_hidden_state[0]
        n = alone.shape[0]
        max_diff = max(max_diff, (embeddings.last_hidden_state[i, :n] - alone).abs().max().item())
print(f"max |batched - per-protein| residue embedding: {max_diff:.6f}")
