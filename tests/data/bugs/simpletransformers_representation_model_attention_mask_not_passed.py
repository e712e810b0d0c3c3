# ThilinaRajapakse/simpletransformers commit 53933d2: "Use attention mask in representation model"
# RepresentationModel.encode_sentences padded each batch of sentences (padding=True) but _tokenize kept only
# input_ids and the model was called as model(input_ids=...), so BertModel got no attention_mask and every token of a
# short sentence attended to the [PAD] positions of the batch. The fix returns the whole encoding from _tokenize and
# passes attention_mask (and token_type_ids) to BertForTextRepresentation.
import os
import sys
import tempfile

import numpy as np
import torch
from transformers import BertConfig, BertTokenizer
from transformers.models.bert.modeling_bert import BertModel, BertPreTrainedModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- language_representation/transformer_models/bert_model.py
# supports both BERT & ROBERTA BASED MODELS
class BertForTextRepresentation(BertPreTrainedModel):
    r"""
   Outputs: `List` of token vectors, 1 list of max_seq token vectors per sentence given
    """  # noqa: ignore flake8"

    def __init__(self, config, weight=None):
        super(BertForTextRepresentation, self).__init__(config)
        self.bert = BertModel(config)
        self.weight = weight
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None):
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            output_hidden_states=True,
        )
        hidden_states = outputs[2]
        return hidden_states[-1]


# ---------------------------------------------------------------- language_representation/representation_model.py
def mean_across_all_tokens(token_vectors):
    return torch.mean(token_vectors, dim=1)


def concat_all_tokens(token_vectors):
    batch_size, max_tokens, emb_dim = token_vectors.shape
    return torch.reshape(token_vectors, (batch_size, max_tokens * emb_dim))


def batch_iterable(iterable, batch_size=1):
    l = len(iterable)
    for ndx in range(0, l, batch_size):
        yield iterable[ndx : min(ndx + batch_size, l)]


class ModelArgs(object):
    max_seq_length = 128
    do_lower_case = True
    manual_seed = 0


class RepresentationModel:
    def __init__(self, model_type, model_dir, config, args=None):
        MODEL_CLASSES = {
            "bert": (BertConfig, BertForTextRepresentation, BertTokenizer),
        }
        self.args = ModelArgs()
        config_class, model_class, tokenizer_class = MODEL_CLASSES[model_type]
        self.config = config
        self.device = "cpu"
        # from_pretrained(model_name) in the project; here a tiny randomly initialised BERT, no download
        self.model = model_class(self.config)
        self.model.eval()
        self.tokenizer = tokenizer_class(os.path.join(model_dir, "vocab.txt"), do_lower_case=self.args.do_lower_case)
        self.args.model_type = model_type

    def _tokenize(self, text_list):
        # Tokenize the text with the provided tokenizer
        # (the project calls tokenizer.batch_encode_plus, which transformers 5 folds into tokenizer(...))
        if FIXED:
            encoded = self.tokenizer(
                text_list,
                add_special_tokens=True,
                max_length=self.args.max_seq_length,
                padding=True,
                truncation=True,
                return_tensors="pt",
            )
            return encoded
        input_ids = self.tokenizer(
            text_list, add_special_tokens=True, max_length=self.args.max_seq_length, padding=True, truncation=True
        )["input_ids"]
        return torch.LongTensor(input_ids)

    def encode_sentences(self, text_list, combine_strategy=None, batch_size=32):
        batches = batch_iterable(text_list, batch_size=batch_size)
        embeddings = np.array([])
        for batch in batches:
            if FIXED:
                encoded = self._tokenize(batch)
                token_vectors = self.model(
                    input_ids=encoded["input_ids"],
                    attention_mask=encoded["attention_mask"],
                    token_type_ids=encoded["token_type_ids"],
                )
            else:
                input_ids_tensor = self._tokenize(batch)
                token_vectors = self.model(input_ids=input_ids_tensor)
            if combine_strategy:
                embedding_func_mapping = {"mean": mean_across_all_tokens, "concat": concat_all_tokens}
                if embedding_func_mapping[combine_strategy]:
                    embedding_func = embedding_func_mapping[combine_strategy]
                else:
                    raise ValueError(
                        "Provided combine_strategy is not valid." "supported values are: 'concat', 'mean' and None."
                    )
                batch_embeddings = embedding_func(token_vectors).detach().numpy()
            else:
                batch_embeddings = token_vectors.detach().numpy()
            if len(embeddings) == 0:
                embeddings = batch_embeddings
            else:
                embeddings = np.concatenate((embeddings, batch_embeddings), axis=0)

        return embeddings


def main():
    model_dir = tempfile.mkdtemp()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + (
        "the a cat dog sat on mat sentence embeddings are useful for semantic search short one long very "
        "of and in to is it"
    ).split()
    with open(os.path.join(model_dir, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    model = RepresentationModel("bert", model_dir, config)

    sentences = [
        "sentence embeddings are useful for semantic search and the cat sat on the mat",
        "a short one",
        "the dog sat",
    ]
    with torch.no_grad():
        word_vectors = model.encode_sentences(sentences, combine_strategy=None, batch_size=3)
        sentence_vectors = model.encode_sentences(sentences, combine_strategy="mean", batch_size=3)
        alone = model.encode_sentences(["a short one"], combine_strategy=None, batch_size=1)
    print("word vectors", word_vectors.shape, "sentence vectors", sentence_vectors.shape)
    n = alone.shape[1]  # [CLS] a short one [SEP]
    print("max |token vectors(batched) - token vectors(alone)| for 'a short one': %.6f"
          % np.abs(word_vectors[1, :n] - alone[0]).max())


if __name__ == "__main__":
    main()
