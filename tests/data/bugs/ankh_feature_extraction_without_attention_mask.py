"""Ankh protein LM feature extraction on a padded batch without its attention mask.

Citation: agemagician/Ankh#24 ("is feature extraction correct due to padding?"), fixed by commit
50f011f ("fixed #24, added attention_mask in the readme example"), both read upstream.

Bug: the README's feature-extraction example tokenized two proteins of different lengths with
``padding=True``, kept only ``['input_ids']`` and called ``model(input_ids=ids)``. Ankh is a
``T5EncoderModel``; with no ``attention_mask`` every residue of the shorter protein attends to the
``<pad>`` positions that pad it to the longer one, so its embeddings depend on its batch neighbour.

Fix: keep the whole ``batch_encode_plus`` output and call
``model(input_ids=outputs['input_ids'], attention_mask=outputs['attention_mask'])``.

This program builds a small ``T5EncoderModel`` from a ``T5Config`` with random weights in place of
``ankh.load_large_model()`` (no download), and a character tokenizer with the Ankh/T5 special ids
(``<pad>`` = 0, ``</s>`` = 1) and ``batch_encode_plus`` output in place of the Ankh tokenizer, then
runs the README example on two short protein fragments.
"""
import sys

import torch
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv

AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWYXBZUO"


class AnkhCharTokenizer:
    """Stand-in for Ankh's tokenizer: one token per residue, ``</s>`` appended, right padding."""

    pad_token_id = 0
    eos_token_id = 1

    def __init__(self):
        self.vocab = {aa: i + 3 for i, aa in enumerate(AMINO_ACIDS)}

    def batch_encode_plus(self, batch, add_special_tokens=True, padding=True, is_split_into_words=True,
                          return_tensors="pt"):
        ids = [[self.vocab[r] for r in words] + ([self.eos_token_id] if add_special_tokens else [])
               for words in batch]
        longest = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), longest), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, :len(x)] = torch.tensor(x)
            attention_mask[i, :len(x)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def load_large_model():
    config = T5Config(vocab_size=144, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=False,
                      use_cache=False)
    return T5EncoderModel(config), AnkhCharTokenizer()


def main():
    torch.manual_seed(0)
    model, tokenizer = load_large_model()
    model.eval()

    protein_sequences = ['MKALCLLLLPVLGLL', 'GSHMSLFDF']

    protein_sequences = [list(seq) for seq in protein_sequences]

    if FIXED:
        outputs = tokenizer.batch_encode_plus(protein_sequences,
                                              add_special_tokens=True,
                                              padding=True,
                                              is_split_into_words=True,
                                              return_tensors="pt")
        with torch.no_grad():
            embeddings = model(input_ids=outputs['input_ids'], attention_mask=outputs['attention_mask'])
    else:
        ids = tokenizer.batch_encode_plus(protein_sequences,
                                          add_special_tokens=True,
                                          padding=True,
                                          is_split_into_words=True,
                                          return_tensors="pt")['input_ids']
        with torch.no_grad():
            embeddings = model(input_ids=ids)
    residue_embeddings = embeddings.last_hidden_state
    print("embeddings", tuple(residue_embeddings.shape),
          "protein 2 mean", round(residue_embeddings[1, :10].mean().item(), 5))


if __name__ == "__main__":
    main()
