"""bio-transformers (DeepChainBio) ``compute_accuracy`` over a padded batch of protein sequences.

Citation: DeepChainBio/bio-transformers#23 (commit b4368a6, "fix: fix padding predictions in
compute_accuracy"; merge e6a60f8), biotransformers/wrappers/transformers_wrappers.py
``TransformersWrapper.compute_accuracy`` / ``_compute_logits`` / ``_model_evaluation``,
biotransformers/wrappers/rostlab_wrapper.py ``RostlabWrapper.process_sequences_and_tokens`` /
``model_pass``, biotransformers/utils/utils.py ``init_model_sequences`` / ``_generate_chunks``.
ProtBert (Rostlab) is a ``BertForMaskedLM`` here built from a tiny ``BertConfig`` with random
weights, its ``BertTokenizer`` from a local amino-acid vocabulary; the ray multi-GPU path is left out.

The bug: the sequences are tokenized together (``padding=True``: right-padded to the longest with
``[PAD]`` and attention_mask 0), run through the model in chunks, and the accuracy was
``mean(argmax(logits) == input_ids)`` over the whole ``[num_seqs, max_len]`` grid, so every padded
slot of a shorter sequence counts as a prediction.

The fix: ``init_model_sequences`` also returns each sequence's length, logits and labels are cut to
``[:length]`` per sequence, and the mean runs over the concatenation of those.
"""

import os
import sys
import tempfile
from typing import Dict, List, Optional, Tuple, Union

import torch
from transformers import BertConfig, BertForMaskedLM, BertTokenizer

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

PROTBERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "L", "A", "G", "V", "E", "S", "I", "K", "R",
                  "D", "T", "P", "N", "Q", "F", "Y", "M", "H", "C", "W", "X", "U", "B", "Z", "O"]


def _generate_chunks(model_inputs: Dict[str, torch.Tensor], batch_size: int):
    """Yield a dictionnary of tensor"""
    num_of_sequences = model_inputs["input_ids"].shape[0]
    for i in range(0, num_of_sequences, batch_size):
        batch_sequence = {key: value[i: (i + batch_size)] for key, value in model_inputs.items()}
        yield batch_sequence


def init_model_sequences(
    sequences: Union[List[str], str],
    model_dir: str,
    model_is_msa: bool,
    n_seqs_msa: int,
    vocab_size: int = 0,
    embeddings_size: int = 0,
    pass_mode: Optional[str] = None,
    pool_mode: Optional[Tuple[str, ...]] = None,
    tokens_list: Optional[List[str]] = None,
) -> Tuple[List, List]:
    if not model_is_msa:
        lengths = [len(sequence) for sequence in sequences]
    else:
        raise ValueError("MSA models are not part of this program.")
    return sequences, lengths


class RostlabWrapper:
    """ProtBert: a BertForMaskedLM over space-separated amino acids."""

    def __init__(self, model_dir: str, device):
        self._model_dir = model_dir
        self._device = device
        vocab_dir = tempfile.mkdtemp()
        with open(os.path.join(vocab_dir, "vocab.txt"), "w") as f:
            f.write("\n".join(PROTBERT_VOCAB) + "\n")
        self.tokenizer = BertTokenizer(os.path.join(vocab_dir, "vocab.txt"), do_lower_case=False)
        config = BertConfig(vocab_size=len(PROTBERT_VOCAB), hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
        self._model = BertForMaskedLM(config).eval().to(self._device)
        self.hidden_size = self._model.config.hidden_size
        self.is_msa = False

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def process_sequences_and_tokens(self, sequences_list: List[str]) -> Dict[str, torch.Tensor]:
        """Function to transform tokens string to IDs; it depends on the model used"""
        separated_sequences_list = [" ".join(seq) for seq in sequences_list]
        encoded_inputs = self.tokenizer(
            separated_sequences_list,
            return_tensors="pt",
            padding=True,
        ).to("cpu")
        return encoded_inputs

    def model_pass(self, model_inputs: Dict[str, torch.Tensor], batch_size: int, silent: bool = False,
                   pba=None) -> Tuple[torch.Tensor, torch.Tensor]:
        batch_generator = _generate_chunks(model_inputs, batch_size)
        logits = torch.Tensor()  # [num_seqs, max_len_seqs+1, vocab_size]
        embeddings = torch.Tensor()  # [num_seqs, max_len_seqs+1, embedding_size]
        for batch_inputs in batch_generator:
            with torch.no_grad():
                model_inputs = {key: value.to(self._device) for key, value in batch_inputs.items()}
                model_outputs = self._model(**model_inputs, output_hidden_states=True)
                batch_logits = model_outputs.logits.detach().cpu()
                batch_embeddings = model_outputs.hidden_states[-1].detach().cpu()
                embeddings = torch.cat((embeddings, batch_embeddings), dim=0)
                logits = torch.cat((logits, batch_logits), dim=0)
        return logits, embeddings


class TransformersWrapper:
    def __init__(self, model_dir: str, device: str = "cpu"):
        self._model_dir = model_dir
        self._language_model = RostlabWrapper(model_dir, device)
        self._multi_gpus = False

    def init_ray_workers(self):
        pass

    def delete_ray_workers(self):
        pass

    def _model_evaluation(self, model_inputs: Dict[str, torch.Tensor], batch_size: int = 1, **kwargs):
        silent = kwargs.get("silent", False)
        logits, embeddings = self._language_model.model_pass(model_inputs, batch_size, silent)
        return logits, embeddings

    def _compute_logits(self, model_inputs: Dict[str, torch.Tensor], batch_size: int, pass_mode: str,
                        **kwargs) -> torch.Tensor:
        if pass_mode == "forward":
            logits, _ = self._model_evaluation(model_inputs, batch_size=batch_size, **kwargs)
        else:
            raise NotImplementedError(pass_mode)
        return logits

    def compute_accuracy(self, sequences: Union[List[str], str], batch_size: int = 1,
                         pass_mode: str = "forward", silent: bool = False, n_seqs_msa: int = 6) -> float:
        """Compute model accuracy from the input sequences"""
        sequences, lengths = init_model_sequences(
            sequences=sequences,
            model_dir=self._model_dir,
            model_is_msa=self._language_model.is_msa,
            n_seqs_msa=n_seqs_msa,
            vocab_size=self._language_model.vocab_size,
            pass_mode=pass_mode,
        )
        self.init_ray_workers()

        # Perform inference in model to compute the logits
        inputs = self._language_model.process_sequences_and_tokens(sequences)
        logits = self._compute_logits(inputs, batch_size, pass_mode, silent=silent)

        if not FIXED:
            # Get length of sequence
            labels = inputs["input_ids"]

            # Get the predicted labels
            predicted_labels = torch.argmax(logits, dim=-1)
            # Compute the accuracy
            accuracy = float(torch.mean(torch.eq(predicted_labels, labels).float()))
        else:
            # Get length of sequence
            labels = torch.unsqueeze(inputs["input_ids"], dim=-1)

            # Remove padded logits
            logits = [
                torch.from_numpy(logit.numpy().transpose()[:, :length].transpose())
                for logit, length in zip(list(logits), lengths)
            ]
            labels = [
                torch.from_numpy(label.numpy().transpose()[:, :length].transpose())
                for label, length in zip(list(labels), lengths)
            ]

            # Get the predicted labels
            predicted_labels = [torch.argmax(logit, dim=-1) for logit in logits]
            # Compute the accuracy
            accuracy = float(
                torch.mean(
                    torch.cat(
                        [
                            torch.eq(predicted_label, label.squeeze()).float()
                            for predicted_label, label in zip(predicted_labels, labels)
                        ],
                        dim=0,
                    ).float()
                )
            )
        self.delete_ray_workers()
        return accuracy


def main():
    bio_trans = TransformersWrapper("Rostlab/prot_bert", device="cpu")
    sequences = [
        "MKTAYIAKQRQISFVKSHFSRQ",
        "MSEQ",
        "KALTARQQEVFDLIRD",
        "GAV",
        "MNIFEMLRIDEGLRLKIYKDTEGYYTIGIGHLL",
        "PEPTIDE",
    ]
    accuracy = bio_trans.compute_accuracy(sequences, batch_size=2)
    print(f"accuracy={accuracy:.6f}")


if __name__ == "__main__":
    main()
