"""ProtTrans (agemagician/ProtTrans): ProtBert per-residue and per-protein embeddings of a padded batch.

Follows agemagician/ProtTrans @65a99296ad8f793529f283ba80f3885088d6cc62: Embedding/PyTorch/Advanced/ProtBert.ipynb
(BertTokenizer(do_lower_case=False) over space-separated residues, re.sub(r"[UZOB]", "X", ...), tokenizer batch
encoding with special tokens and padding to the longest protein, BertModel(...)[0] under torch.no_grad() in eval
mode, then "Remove padding ([PAD]) and special tokens ([CLS],[SEP])": seq_len = (attention_mask[seq_num] == 1).sum(),
seq_emd = embedding[seq_num][1:seq_len-1]); the per-protein embedding is the mean of those per-residue rows, as the
ProtTrans README does (`emb_0.mean(dim=0)`). The vocabulary is Rostlab/prot_bert's vocab.txt, written to a temporary
file; the model is a tiny BertConfig with random weights (no download). transformers 5 dropped batch_encode_plus,
so the batch is encoded with tokenizer(..., add_special_tokens=True, padding="longest"), the same call.

Each protein is [CLS] residues [SEP] followed by [PAD] (right padding); BertModel turns attention_mask into the
padding mask of its attention, so real tokens never attend the pads; the slice 1:seq_len-1 keeps the residues only.

Checked (eval, float64): each protein's per-residue rows equal the same protein embedded alone (no padding, no
mask), and each per-protein vector equals a double loop (residue x hidden unit) mean over that lone run's residues.
"""
import os
import random
import re
import tempfile

import numpy as np
import torch
from transformers import BertConfig, BertModel, BertTokenizer

# Rostlab/prot_bert vocab.txt, in file order.
PROT_BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                   "L", "A", "G", "V", "E", "S", "I", "K", "R", "D", "T", "P", "N", "Q", "F",
                   "Y", "M", "H", "C", "W", "X", "U", "B", "Z", "O"]


def load_tokenizer(directory):
    vocab_file = os.path.join(directory, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(PROT_BERT_VOCAB) + "\n")
    return BertTokenizer.from_pretrained(directory, do_lower_case=False)


def load_model():
    config = BertConfig(
        vocab_size=len(PROT_BERT_VOCAB),
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=40000,
        type_vocab_size=2,
        pad_token_id=0,
    )
    return BertModel(config, add_pooling_layer=False)


def embed(tokenizer, model, device, sequences_Example):
    sequences_Example = [re.sub(r"[UZOB]", "X", sequence) for sequence in sequences_Example]

    ids = tokenizer(sequences_Example, add_special_tokens=True, padding="longest")

    input_ids = torch.tensor(ids['input_ids']).to(device)
    attention_mask = torch.tensor(ids['attention_mask']).to(device)

    with torch.no_grad():
        embedding = model(input_ids=input_ids, attention_mask=attention_mask)[0]

    embedding = embedding.cpu().numpy()

    features = []
    for seq_num in range(len(embedding)):
        seq_len = (attention_mask[seq_num] == 1).sum()
        seq_emd = embedding[seq_num][1:seq_len-1]
        features.append(seq_emd)

    per_protein = [seq_emd.mean(axis=0) for seq_emd in features]
    return features, per_protein, input_ids, attention_mask


def embed_alone(tokenizer, model, device, sequence):
    """The reference: one protein, no padding, no attention mask; drop [CLS] and [SEP]."""
    sequence = re.sub(r"[UZOB]", "X", sequence)
    ids = tokenizer(sequence, add_special_tokens=True)
    input_ids = torch.tensor([ids['input_ids']]).to(device)
    with torch.no_grad():
        hidden = model(input_ids=input_ids)[0]
    return hidden[0].cpu().numpy()[1:-1]


def main():
    torch.manual_seed(0)
    random.seed(0)
    torch.set_default_dtype(torch.float64)

    device = torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')
    model = load_model()
    model = model.to(device)
    model = model.eval()

    amino_acids = "LAGVESIKRDTPNQFYMHCWUZOB"
    lengths = [9, 23, 4, 16, 1]
    proteins = ["".join(random.choice(amino_acids) for _ in range(n)) for n in lengths]
    sequences_Example = [" ".join(protein) for protein in proteins]

    with tempfile.TemporaryDirectory() as directory:
        tokenizer = load_tokenizer(directory)
        features, per_protein, input_ids, attention_mask = embed(tokenizer, model, device, sequences_Example)

        assert input_ids.shape == (len(proteins), max(lengths) + 2)
        for seq_num, protein in enumerate(proteins):
            n = len(protein)
            assert input_ids[seq_num, 0].item() == tokenizer.cls_token_id
            assert input_ids[seq_num, n + 1].item() == tokenizer.sep_token_id
            assert (input_ids[seq_num, n + 2:] == tokenizer.pad_token_id).all()
            assert features[seq_num].shape == (n, model.config.hidden_size)

            alone = embed_alone(tokenizer, model, device, sequences_Example[seq_num])
            assert alone.shape == features[seq_num].shape
            err = np.abs(features[seq_num] - alone).max()
            assert err < 1e-10, (seq_num, err)

            mean = np.zeros(model.config.hidden_size)
            for i in range(n):
                for d in range(model.config.hidden_size):
                    mean[d] += alone[i, d] / n
            err = np.abs(per_protein[seq_num] - mean).max()
            assert err < 1e-10, (seq_num, err)

    print("per-residue:", [f.shape for f in features])
    print("per-protein:", np.stack(per_protein).shape)
    print("ok")


if __name__ == "__main__":
    main()
