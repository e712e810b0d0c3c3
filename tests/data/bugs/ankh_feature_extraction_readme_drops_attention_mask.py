# Ankh protein LM (agemagician/Ankh#24, fixed in commit 50f011f): the feature-extraction example kept only
# tokenizer(...)['input_ids'] of a padded batch and called the T5 encoder without attention_mask, so every residue
# attended to the <pad> positions; the fix passes attention_mask=outputs['attention_mask'] to the model.
import sys

import torch
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

AMINO = "ACDEFGHIKLMNPQRSTVWYXBZUO"


class AnkhTokenizer:
    """Stand-in for the Ankh character-level T5 tokenizer: <pad>=0, </s>=1, one token per residue."""

    pad_token_id, eos_token_id = 0, 1
    vocab = {a: i + 3 for i, a in enumerate(AMINO)}

    def batch_encode_plus(self, batch, add_special_tokens=True, padding=True, is_split_into_words=True,
                          return_tensors="pt"):
        ids = [[self.vocab[a] for a in seq] + ([self.eos_token_id] if add_special_tokens else []) for seq in batch]
        L = max(len(x) for x in ids)
        input_ids = torch.tensor([x + [self.pad_token_id] * (L - len(x)) for x in ids])
        attention_mask = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in ids])
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def load_large_model():
    # ankh.load_large_model() -> T5EncoderModel.from_pretrained("ElnaggarLab/ankh-large"); here: same class,
    # tiny random config (gated-gelu T5 encoder with relative position buckets, like Ankh)
    config = T5Config(vocab_size=144, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=64, relative_attention_max_distance=128,
                      feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                      is_encoder_decoder=False, use_cache=False)
    return T5EncoderModel(config), AnkhTokenizer()


model, tokenizer = load_large_model()
model.eval()

protein_sequences = ["MKALCLLLLPVLGLLVSSKTLCSMEEAINERI", "GSHMSLFDFFKNKGSA"]
protein_sequences = [list(seq) for seq in protein_sequences]

if not FIXED:
    ids = tokenizer.batch_encode_plus(protein_sequences,
                                      add_special_tokens=True,
                                      padding=True,
                                      is_split_into_words=True,
                                      return_tensors="pt")['input_ids']
    with torch.no_grad():
        embeddings = model(input_ids=ids)
else:
    outputs = tokenizer.batch_encode_plus(protein_sequences,
                                          add_special_tokens=True,
                                          padding=True,
                                          is_split_into_words=True,
                                          return_tensors="pt")
    with torch.no_grad():
        embeddings = model(input_ids=outputs['input_ids'], attention_mask=outputs['attention_mask'])

# reference: the short protein embedded on its own (no padding at all)
single = tokenizer.batch_encode_plus([protein_sequences[1]])
with torch.no_grad():
    ref = model(input_ids=single["input_ids"], attention_mask=single["attention_mask"])[0][0]

n = ref.shape[0]
diff = (embeddings[0][1, :n] - ref).abs().max().item()
print(f"fixed={FIXED} max |residue embeddings(short protein, padded batch) - alone| = {diff:.6f}")
