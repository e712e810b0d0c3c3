"""hopsparser's BERT lexer ran its transformer over a right-padded batch without the attention mask.

Citation: hopsparser/hopsparser commit 4e6e5c4 "fix!: Use attention mask for BERT lexers"
(in hopsparser/hopsparser#68 "Correct handling of padding in word embeddings"), file hopsparser/lexers.py.

The bug: ``BertLexer.make_batch`` pads the sentences' encodings with ``tokenizer.pad`` (right padding,
which also builds an ``attention_mask``), but ``BertLexer.forward`` called
``self.model(input_ids=inpt.encoding["input_ids"], return_dict=True, output_hidden_states=True)``:
the model then attends every [PAD] slot, so a sentence's word embeddings depend on what it was batched
with. The fix passes ``attention_mask=inpt.encoding["attention_mask"]`` as well.

Ported from lexers.py (BertLexerBatch, BertLexerSentence, BertLexer.forward / make_batch / encode, fast
tokenizer branch) at toy sizes: a tiny WordPiece vocabulary written to a temporary folder, a 2-layer
BertModel built from a config with random weights, ``layers=None`` (all layers averaged),
``subwords_reduction="first"``, ``weight_layers=False``. The batch's make_batch returns the two fields
BertLexerBatch holds. The word embeddings feed a small stand-in arc scorer, as the parser does.
"""

import math
import pathlib
import sys
import tempfile
from typing import List, Literal, NamedTuple, Optional, Sequence, TypeVar, Union

import torch
import transformers
from torch import nn
from transformers.tokenization_utils_base import BatchEncoding, TokenSpan

FIXED = "--fixed" in sys.argv


class LexingError(Exception):
    def __init__(self, message: str, sentence: Optional[str] = None):
        self.message = message
        self.sentence = sentence
        super().__init__(self.message)


_T_BertLexerBatch = TypeVar("_T_BertLexerBatch", bound="BertLexerBatch")


class BertLexerBatch(NamedTuple):
    encoding: BatchEncoding
    subword_alignments: Sequence[Sequence[TokenSpan]]

    def to(
        self: _T_BertLexerBatch, device: Union[str, torch.device]
    ) -> _T_BertLexerBatch:
        return type(self)(
            self.encoding.to(device=device),
            self.subword_alignments,
        )


class BertLexerSentence(NamedTuple):
    encoding: BatchEncoding
    subwords_alignments: Sequence[TokenSpan]


class BertLexer(nn.Module):
    """
    This Lexer performs tokenization and embedding mapping with BERT
    style models.
    """

    def __init__(
        self,
        layers: Optional[Sequence[int]],
        model: transformers.PreTrainedModel,
        subwords_reduction: Literal["first", "mean"],
        tokenizer: transformers.PreTrainedTokenizerBase,
        weight_layers: bool,
    ):
        super().__init__()

        self.model = model
        self.tokenizer = tokenizer

        self.max_length = min(
            self.tokenizer.max_len_single_sentence,
            getattr(self.model.config, "max_position_embeddings", math.inf)
            - self.tokenizer.num_special_tokens_to_add(pair=False),
        )

        self.output_dim = self.model.config.hidden_size

        # 🤗 has no unified API for the number of layers
        num_layers = min(
            getattr(model.config, param_name, math.inf)
            for param_name in ("num_layers", "n_layers", "num_hidden_layers")
        )
        if layers is None:
            layers = list(range(num_layers))
        elif not all(-num_layers <= layer_idx < num_layers for layer_idx in layers):
            raise ValueError(
                f"Wrong layers selections for a model with {num_layers} layers: {layers}"
            )
        self.layers = layers
        # Deactivate layerdrop if available
        if hasattr(self.model, "layerdrop"):
            self.model.layerdrop = 0.0
        self.subwords_reduction = subwords_reduction
        self.weight_layers = weight_layers
        self.layer_weights = nn.Parameter(
            torch.ones(len(layers), dtype=torch.float),
            requires_grad=self.weight_layers,
        )
        self.layers_gamma = nn.Parameter(
            torch.ones(1, dtype=torch.float),
            requires_grad=self.weight_layers,
        )

    def forward(self, inpt: BertLexerBatch) -> torch.Tensor:
        if FIXED:
            layers = self.model(
                input_ids=inpt.encoding["input_ids"],
                attention_mask=inpt.encoding["attention_mask"],
                return_dict=True,
                output_hidden_states=True,
            ).hidden_states
        else:
            layers = self.model(
                input_ids=inpt.encoding["input_ids"],
                return_dict=True,
                output_hidden_states=True,
            ).hidden_states
        # Shape: layers×batch×sequence×features
        selected_layers = torch.stack([layers[i] for i in self.layers], 0)

        if self.weight_layers:
            # Shape: layers
            normal_weights = self.layer_weights.softmax(dim=0)
            # shape: batch×subwords_sequence×features
            subword_embeddings = self.layers_gamma * torch.einsum(
                "l,lbsf->bsf", normal_weights, selected_layers
            )
        else:
            subword_embeddings = selected_layers.mean(dim=0)
        # We already know the shape the BERT embeddings should have and we pad with zeros
        # shape: batch×sentence(WITH ROOT TOKEN)×features
        word_embeddings = subword_embeddings.new_zeros(
            (
                len(inpt.subword_alignments),
                max(len(s) for s in inpt.subword_alignments) + 1,
                subword_embeddings.shape[2],
            )
        )
        word_embeddings[:, 0, ...] = subword_embeddings.mean(dim=1)
        for sent_n, alignment in enumerate(inpt.subword_alignments):
            # The word indices start at 1 because word 0 is the root token, for which we have no
            # bert embedding so we use the average of all subword embeddings
            for word_n, span in enumerate(alignment, start=1):
                # shape: `span.end-span.start×features`
                this_word_subword_embeddings = subword_embeddings[
                    sent_n, span.start : span.end, ...
                ]
                if self.subwords_reduction == "first":
                    reduced_bert_word_embedding = this_word_subword_embeddings[0, ...]
                elif self.subwords_reduction == "mean":
                    reduced_bert_word_embedding = this_word_subword_embeddings.mean(
                        dim=0
                    )
                else:
                    raise ValueError(f"Unknown reduction {self.subwords_reduction}")
                word_embeddings[sent_n, word_n, ...] = reduced_bert_word_embedding

        return word_embeddings

    def make_batch(
        self,
        batch: Sequence[BertLexerSentence],
    ) -> BertLexerBatch:
        """Pad a batch of sentences."""
        encodings_lst, subwords_alignments = [], []
        for sent in batch:
            encodings_lst.append(sent.encoding)
            subwords_alignments.append(sent.subwords_alignments)
        encoding = self.tokenizer.pad(encodings_lst)
        encoding.convert_to_tensors("pt")
        return BertLexerBatch(
            encoding,
            subwords_alignments,
        )

    def encode(self, tokens_sequence: Sequence[str]) -> BertLexerSentence:
        # The root token is removed here since the BERT model has no reason to know of it
        unrooted_tok_sequence = tokens_sequence[1:]
        bert_encoding = self.tokenizer(
            unrooted_tok_sequence,
            is_split_into_words=True,
            return_special_tokens_mask=True,
        )
        if len(bert_encoding.data["input_ids"]) > self.max_length:
            raise LexingError(
                f"Sentence too long for this transformer model ({len(bert_encoding.data['input_ids'])} tokens > {self.max_length})",
                str(unrooted_tok_sequence),
            )
        alignments = [
            bert_encoding.word_to_tokens(i) for i in range(len(unrooted_tok_sequence))
        ]
        i = next((i for i, a in enumerate(alignments) if a is None), None)
        if i is not None:
            raise LexingError(
                f"Unencodable token {unrooted_tok_sequence[i]!r} at {i}",
                str(unrooted_tok_sequence),
            )
        return BertLexerSentence(bert_encoding, alignments)


VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
    "le", "chat", "dort", "sur", "la", "table", "du", "salon", "pendant", "que",
    "les", "enfants", "jouent", "dans", "jardin", "mange", "##s", "##ent", "petit", ".",
]


def build_tokenizer(folder: pathlib.Path) -> transformers.BertTokenizerFast:
    vocab_file = folder / "vocab.txt"
    vocab_file.write_text("\n".join(VOCAB) + "\n")
    return transformers.BertTokenizerFast(
        vocab_file=str(vocab_file), do_lower_case=True, model_max_length=64
    )


def main():
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(pathlib.Path(tmp))
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertModel(config).eval()
    lexer = BertLexer(
        layers=None,
        model=model,
        subwords_reduction="first",
        tokenizer=tokenizer,
        weight_layers=False,
    ).eval()

    # Sentences as the parser reads them: word 0 is the root token.
    sentences = [
        ["<root>", "le", "chat", "dort", "."],
        ["<root>", "les", "enfants", "jouent", "dans", "le", "jardin", "du", "salon",
         "pendant", "que", "le", "petit", "chat", "mange", "sur", "la", "table", "."],
    ]
    batch = lexer.make_batch([lexer.encode(s) for s in sentences])

    # A small biaffine-like arc scorer over the word embeddings, standing in for the parser.
    arc_proj = nn.Linear(lexer.output_dim, lexer.output_dim, bias=False)
    with torch.no_grad():
        word_embeddings = lexer(batch)
        scores = torch.einsum("bif,fg,bjg->bij", word_embeddings, arc_proj.weight, word_embeddings)
    n_words = len(sentences[0])
    heads = scores[0, 1:n_words, :n_words].argmax(dim=-1)
    print("input_ids shape:", tuple(batch.encoding["input_ids"].shape))
    print("sentence 0 word embeddings (first 4 features):")
    print(word_embeddings[0, :n_words, :4])
    print("sentence 0 predicted heads:", heads.tolist())


if __name__ == "__main__":
    main()
