# Correct program (quiet batch quiet-r81a).
# Ported from shibing624/text2vec:
#   text2vec/sentence_model.py @019c9605d0163983b2238e83f680027eb80ef45e (EncoderType, SentenceModel
#     .get_sentence_embeddings: `self.bert(input_ids, attention_mask, token_type_ids, output_hidden_states=True)`, then
#     MEAN = sum(last_hidden_state * attention_mask) / clamp(attention_mask.sum(1), 1e-9), CLS = last_hidden_state[:, 0],
#     POOLER = pooler_output; SentenceModel.encode: sentences sorted by length, tokenizer(padding=True,
#     truncation=True) per batch, optional L2 normalisation, the order restored with argsort),
#   text2vec/cosent_dataset.py @05774a5a197bca7dc4e9ced80219be8831190423 (CosentTrainDataset.text_2_id:
#     tokenizer(text, padding='max_length') per sentence, so a batch is (B, 1, max_len) and squeezed),
#   text2vec/cosent_model.py @05774a5a197bca7dc4e9ced80219be8831190423 (CosentModel.calc_loss: even / odd rows are the
#     pairs, cosine * 20, every (i, j) difference kept where y_true[i] < y_true[j] and pushed down by 1e12 elsewhere,
#     logsumexp with a leading 0; the training step's squeeze(1) of input_ids / attention_mask / token_type_ids).
# Trimmed: from_pretrained is replaced by a tiny BertModel from a BertConfig and a BertTokenizer over a vocab file
# written to a temp dir; get_sentence_embeddings keeps the MEAN, CLS and POOLER branches only (the ones run here);
# the optimizer loop is one forward / backward.
# Right padding throughout (BERT's tokenizer); the padded positions are masked inside BertModel by attention_mask and
# kept out of the MEAN pooling by the same mask.
# Self-check: every sentence alone, tokenized unpadded and run with no mask, gives the reference MEAN / CLS / POOLER
# embedding; encode() (sorted, padding=True batches of 2) and the max_length training batch must match it, and
# calc_loss must equal a double loop over the kept pairs of reference cosines.
import os
import tempfile
from enum import Enum
from typing import List, Optional, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertModel, BertTokenizer


# --- text2vec/sentence_model.py ---
class EncoderType(Enum):
    FIRST_LAST_AVG = 0
    LAST_AVG = 1
    CLS = 2
    POOLER = 3
    MEAN = 4

    def __str__(self):
        return self.name

    @staticmethod
    def from_string(s):
        try:
            return EncoderType[s]
        except KeyError:
            raise ValueError()


class SentenceModel:
    def __init__(self, bert, tokenizer, encoder_type: Union[str, EncoderType] = "MEAN",
                 max_seq_length: int = 256, device: Optional[str] = None):
        encoder_type = EncoderType.from_string(encoder_type) if isinstance(encoder_type, str) else encoder_type
        if encoder_type not in list(EncoderType):
            raise ValueError(f"encoder_type must be in {list(EncoderType)}")
        self.encoder_type = encoder_type
        self.max_seq_length = max_seq_length
        self.tokenizer = tokenizer
        self.bert = bert
        if device is None:
            device = "cpu"
        self.device = torch.device(device)
        self.bert.to(self.device)
        self.results = {}

    def get_sentence_embeddings(self, input_ids, attention_mask, token_type_ids=None):
        """
        Returns the model output by encoder_type as embeddings.
        """
        model_output = self.bert(input_ids, attention_mask, token_type_ids, output_hidden_states=True)

        if self.encoder_type == EncoderType.CLS:
            sequence_output = model_output.last_hidden_state
            return sequence_output[:, 0]  # [batch, hid_size]

        if self.encoder_type == EncoderType.POOLER:
            return model_output.pooler_output  # [batch, hid_size]

        if self.encoder_type == EncoderType.MEAN:
            """
            Mean Pooling - Take attention mask into account for correct averaging
            """
            token_embeddings = model_output.last_hidden_state  # Contains all token embeddings
            input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
            final_encoding = torch.sum(token_embeddings * input_mask_expanded, 1) / torch.clamp(
                input_mask_expanded.sum(1), min=1e-9)
            return final_encoding  # [batch, hid_size]
        raise NotImplementedError(str(self.encoder_type))

    @torch.inference_mode()
    def encode(self, sentences: Union[str, List[str]], batch_size: int = 64, convert_to_numpy: bool = True,
               convert_to_tensor: bool = False, device: str = None, normalize_embeddings: bool = False):
        self.bert.eval()
        if device is None:
            device = self.device
        if convert_to_tensor:
            convert_to_numpy = False
        input_is_string = False
        if isinstance(sentences, str) or not hasattr(sentences, "__len__"):
            sentences = [sentences]
            input_is_string = True

        all_embeddings = []
        length_sorted_idx = np.argsort([-len(s) for s in sentences])
        sentences_sorted = [sentences[idx] for idx in length_sorted_idx]
        for start_index in range(0, len(sentences), batch_size):
            sentences_batch = sentences_sorted[start_index: start_index + batch_size]
            embeddings = self.get_sentence_embeddings(
                **self.tokenizer(sentences_batch, max_length=self.max_seq_length,
                                 padding=True, truncation=True, return_tensors='pt').to(device)
            )
            embeddings = embeddings.detach()
            if normalize_embeddings:
                embeddings = torch.nn.functional.normalize(embeddings, p=2, dim=1)
            if convert_to_numpy:
                embeddings = embeddings.cpu()
            all_embeddings.extend(embeddings)
        all_embeddings = [all_embeddings[idx] for idx in np.argsort(length_sorted_idx)]
        if convert_to_tensor:
            all_embeddings = torch.stack(all_embeddings)
        elif convert_to_numpy:
            all_embeddings = np.asarray([emb.numpy() for emb in all_embeddings])
        if input_is_string:
            all_embeddings = all_embeddings[0]
        return all_embeddings


# --- text2vec/cosent_dataset.py ---
class CosentTrainDataset(Dataset):
    def __init__(self, tokenizer, data: list, max_len: int = 64):
        self.tokenizer = tokenizer
        self.data = data
        self.max_len = max_len

    def __len__(self):
        return len(self.data)

    def text_2_id(self, text: str):
        return self.tokenizer(text, max_length=self.max_len, truncation=True,
                              padding='max_length', return_tensors='pt')

    def __getitem__(self, index: int):
        line = self.data[index]
        return self.text_2_id(line[0]), line[1]


# --- text2vec/cosent_model.py ---
class CosentModel(SentenceModel):
    def calc_loss(self, y_true, y_pred):
        y_true = y_true[::2]
        norms = (y_pred ** 2).sum(axis=1, keepdims=True) ** 0.5
        y_pred = y_pred / norms
        y_pred = torch.sum(y_pred[::2] * y_pred[1::2], dim=1) * 20
        y_pred = y_pred[:, None] - y_pred[None, :]
        y_true = y_true[:, None] < y_true[None, :]
        y_true = y_true.float()
        y_pred = y_pred - (1 - y_true) * 1e12
        y_pred = y_pred.view(-1)
        y_pred = torch.cat((torch.tensor([0]).float().to(self.device), y_pred), dim=0)
        return torch.logsumexp(y_pred, dim=0)

    def train_step(self, batch):
        self.bert.train()
        inputs, labels = batch
        labels = labels.to(self.device)
        input_ids = inputs.get('input_ids').squeeze(1).to(self.device)
        attention_mask = inputs.get('attention_mask').squeeze(1).to(self.device)
        token_type_ids = inputs.get('token_type_ids').squeeze(1).to(self.device)
        output_embeddings = self.get_sentence_embeddings(input_ids, attention_mask, token_type_ids)
        loss = self.calc_loss(labels, output_embeddings)
        loss.backward()
        return loss, output_embeddings


def main():
    torch.manual_seed(0)
    words = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away", "red", "ball", "is", "big",
             "small", "house", "tree", "green", "sun", "rain"]
    tmp = tempfile.mkdtemp()
    vocab_file = os.path.join(tmp, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    tokenizer = BertTokenizer(vocab_file)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    bert = BertModel(config)

    sentences = ["the cat sat on the mat", "a dog", "the red ball is big", "sun",
                 "a small green tree ran far away", "rain on the house"]
    max_len = 12

    @torch.no_grad()
    def alone(sentence, encoder_type):
        enc = tokenizer(sentence, return_tensors='pt')  # no padding: exactly its own tokens
        out = bert(input_ids=enc['input_ids'], token_type_ids=enc['token_type_ids'])
        if encoder_type == "MEAN":
            return out.last_hidden_state[0].mean(0)
        if encoder_type == "CLS":
            return out.last_hidden_state[0, 0]
        return out.pooler_output[0]

    bert.eval()
    for encoder_type in ["MEAN", "CLS", "POOLER"]:
        model = SentenceModel(bert, tokenizer, encoder_type=encoder_type, max_seq_length=max_len)
        ref = torch.stack([alone(s, encoder_type) for s in sentences])
        got = model.encode(sentences, batch_size=2, convert_to_tensor=True)
        assert torch.allclose(got, ref, atol=1e-5), f"encode() {encoder_type}"
        got_n = model.encode(sentences, batch_size=4, convert_to_tensor=True, normalize_embeddings=True)
        assert torch.allclose(got_n, torch.nn.functional.normalize(ref, dim=1), atol=1e-5), f"normalized {encoder_type}"

    # CoSENT training batch: pairs (text_a, text_b) flattened, each padded to max_length
    pairs = [(sentences[0], sentences[4], 1), (sentences[1], sentences[3], 0),
             (sentences[2], sentences[5], 1), (sentences[3], sentences[0], 0)]
    data = []
    for a, b, score in pairs:
        data.append((a, score))
        data.append((b, score))
    dataset = CosentTrainDataset(tokenizer, data, max_len)
    loader = DataLoader(dataset, shuffle=False, batch_size=len(data))
    batch = next(iter(loader))
    assert batch[0]['attention_mask'].shape == (len(data), 1, max_len)
    assert (batch[0]['attention_mask'].sum(-1) < max_len).all()

    model = CosentModel(bert, tokenizer, encoder_type="MEAN", max_seq_length=max_len)
    loss, emb = model.train_step(batch)
    ref = torch.stack([alone(s, "MEAN") for s, _ in data])
    assert torch.allclose(emb.detach(), ref, atol=1e-5), "training-batch MEAN embeddings"

    cos = [float(torch.nn.functional.cosine_similarity(ref[2 * k], ref[2 * k + 1], dim=0)) * 20
           for k in range(len(pairs))]
    labels = [p[2] for p in pairs]
    terms = [0.0]
    for i in range(len(pairs)):
        for j in range(len(pairs)):
            if labels[i] < labels[j]:
                terms.append(cos[i] - cos[j])
    ref_loss = torch.logsumexp(torch.tensor(terms), dim=0)
    assert torch.allclose(loss.detach(), ref_loss, atol=1e-4), (loss, ref_loss)
    assert all(p.grad is not None for p in bert.encoder.parameters())
    print(f"ok: encode() MEAN / CLS / POOLER and the CoSENT batch match unpadded single-sentence runs; "
          f"loss {loss.item():.4f}")


if __name__ == '__main__':
    main()
