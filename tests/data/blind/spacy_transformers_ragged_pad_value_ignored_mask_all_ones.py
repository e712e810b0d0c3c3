# explosion/spacy-transformers#136 (reports #132, #135): RaggedArray.to_padded() padded with 0 whatever value
# was asked for and get_model_kwargs marked padding as ids < 0, so BERT's attention_mask was all ones.
import sys

import numpy
import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv


class RaggedArray:
    def __init__(self, data, lengths):
        self.data = data
        self.lengths = list(lengths)

    def to_padded(self, value=0):
        max_len = max(self.lengths)
        shape = (len(self.lengths), max_len) + self.data.shape[1:]
        if FIXED:
            padded = numpy.full(shape, value, dtype=self.data.dtype)
        else:
            padded = numpy.zeros(shape, dtype=self.data.dtype)
        start = 0
        for i, length in enumerate(self.lengths):
            padded[i, :length] = self.data[start:start + length]
            start += length
        return padded


class TransformersWrapper:
    def __init__(self, model, max_length=512):
        self._model = model
        self.max_length = max_length

    def get_model_kwargs(self, inputs):
        if FIXED:
            padded = inputs.to_padded(value=-1)
        else:
            padded = inputs.to_padded()
        if padded.ndim == 2:
            padded = padded.reshape(padded.shape + (1,))
        if self.max_length:
            padded = padded[:, : self.max_length]
        ids = padded[:, :, 0]
        neg_idx = ids < 0
        ids[neg_idx] = 0
        ids = torch.as_tensor(ids, dtype=torch.int64)
        segment_ids = torch.zeros_like(ids)
        # Calculate "attention mask" for BERT
        mask = numpy.ones(ids.shape, dtype=numpy.int_)
        mask[neg_idx] = 0
        mask = torch.as_tensor(mask)
        return {"input_ids": ids, "token_type_ids": segment_ids, "attention_mask": mask}

    def predict(self, inputs):
        kwargs = self.get_model_kwargs(inputs)
        with torch.no_grad():
            return self._model(**kwargs).last_hidden_state


def main():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertModel(config, add_pooling_layer=False).eval()
    wrapper = TransformersWrapper(model)

    # wordpiece ids of two docs, concatenated as spaCy keeps them ([CLS]=2, [SEP]=3, [PAD]=0)
    doc1 = [2, 11, 17, 5, 3]
    doc2 = [2, 8, 9, 10, 21, 22, 23, 24, 25, 3]
    inputs = RaggedArray(numpy.array(doc1 + doc2, dtype=numpy.int64), [len(doc1), len(doc2)])
    batched = wrapper.predict(inputs)
    alone = wrapper.predict(RaggedArray(numpy.array(doc1, dtype=numpy.int64), [len(doc1)]))
    diff = (batched[0, :len(doc1)] - alone[0]).abs().max().item()
    print(f"fixed={FIXED} doc1 vectors, batched with a longer doc vs alone: max |diff| = {diff:.3e}")


if __name__ == "__main__":
    main()
