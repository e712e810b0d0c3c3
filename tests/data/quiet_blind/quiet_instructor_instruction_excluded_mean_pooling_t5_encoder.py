# Correct program (quiet batch quiet-zx).
# Ported from xlang-ai/instructor-embedding @619dda2bfbab22b3e623cb5893472eacae19f4a1:
#   InstructorEmbedding/instructor.py
#     INSTRUCTOR_Transformer.tokenize (list branch: each example is [instruction, text]; the concatenation
#       ''.join([instruction, text]) and the instruction alone are tokenized with padding=True; context_masks =
#       sum(instruction attention_mask) - 1, set to 0 when <= 1),
#     INSTRUCTOR_Transformer.forward (the encoder sees the whole right-padded row with its attention_mask; afterwards
#       attention_mask[local_idx][:context_masks[local_idx]] = 0, in place, so the instruction tokens drop out of
#       the pooling only),
#     INSTRUCTOR_Pooling.forward (mean pooling: sum(token_embeddings * mask) / clamp(mask.sum(1), 1e-9)),
#     INSTRUCTOR.encode (sort by -len(text), batches, unsort with argsort, optional L2 normalisation).
# The auto_model is T5EncoderModel (INSTRUCTOR checkpoints are GTR-T5 encoders), built from a tiny T5Config with random
# weights. SentenceTransformer is replaced by a small nn.Sequential of the two ported modules, and the T5 sentencepiece
# tokenizer by a whitespace tokenizer with T5's conventions (pad id 0, </s> id 1 appended, right padding).
# Self-check: every [instruction, text] alone, unpadded, through the same encoder with no mask; the reference embedding
# is the plain mean of the hidden states from the first text token through </s> (or of the whole row when the
# instruction is one token or none). encode()'s embeddings (raw and normalised, two batches of different widths,
# length-sorted and unsorted) must match.
import sys

import numpy as np
import torch
import torch.nn as nn
from transformers import T5Config, T5EncoderModel

torch.manual_seed(0)


class WhitespaceT5Tokenizer:
    """Stands in for the T5 sentencepiece tokenizer: pad 0, </s> 1, words from 2, right padding."""

    pad_token_id, eos_token_id = 0, 1

    def __init__(self, words):
        self.vocab = {w: i + 2 for i, w in enumerate(sorted(set(words)))}

    def encode_one(self, text):
        return [self.vocab[w] for w in text.split()] + [self.eos_token_id]

    def __call__(self, texts, padding=True, truncation="longest_first", return_tensors="pt", max_length=512):
        ids = [self.encode_one(t)[:max_length] for t in texts]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([x + [self.pad_token_id] * (width - len(x)) for x in ids])
        attention_mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        return {"input_ids": input_ids, "attention_mask": attention_mask}


# --- InstructorEmbedding/instructor.py ---
class INSTRUCTOR_Pooling(nn.Module):
    def __init__(self, word_embedding_dimension, pooling_mode_mean_tokens=True):
        super(INSTRUCTOR_Pooling, self).__init__()
        self.word_embedding_dimension = word_embedding_dimension
        self.pooling_mode_mean_tokens = pooling_mode_mean_tokens

    def forward(self, features):
        token_embeddings = features['token_embeddings']
        attention_mask = features['attention_mask']

        ## Pooling strategy
        output_vectors = []
        if self.pooling_mode_mean_tokens:
            input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
            sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)

            # If tokens are weighted (by WordWeights layer), feature 'token_weights_sum' will be present
            if 'token_weights_sum' in features:
                sum_mask = features['token_weights_sum'].unsqueeze(-1).expand(sum_embeddings.size())
            else:
                sum_mask = input_mask_expanded.sum(1)

            sum_mask = torch.clamp(sum_mask, min=1e-9)
            output_vectors.append(sum_embeddings / sum_mask)

        output_vector = torch.cat(output_vectors, 1)
        features.update({'sentence_embedding': output_vector})
        return features


class INSTRUCTOR_Transformer(nn.Module):
    def __init__(self, auto_model, tokenizer, max_seq_length=512, do_lower_case=False):
        super().__init__()
        self.auto_model = auto_model
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.do_lower_case = do_lower_case

    def forward(self, features):
        """Returns token_embeddings, cls_token"""
        trans_features = {'input_ids': features['input_ids'], 'attention_mask': features['attention_mask']}
        if 'token_type_ids' in features:
            trans_features['token_type_ids'] = features['token_type_ids']

        context_masks = None
        if 'context_masks' in features:
            context_masks = features['context_masks']
        output_states = self.auto_model(**trans_features, return_dict=False)
        output_tokens = output_states[0]
        attention_mask = features['attention_mask']
        if context_masks is not None:
            assert len(context_masks) == len(attention_mask)
            n = len(attention_mask)
            for local_idx in range(n):
                assert torch.sum(attention_mask[local_idx]).item() >= context_masks[local_idx].item(),\
                    f'{attention_mask[local_idx]}, {context_masks[local_idx]}, ' \
                    f'{torch.sum(attention_mask[local_idx]).item()}, {context_masks[local_idx].item()}'
                attention_mask[local_idx][:context_masks[local_idx]] = 0

        features.update({'token_embeddings': output_tokens, 'attention_mask': attention_mask})
        return features

    def tokenize(self, texts):
        """
        Tokenizes a text and maps tokens to token-ids
        """
        output = {}
        if isinstance(texts[0], str):
            to_tokenize = [texts]
            to_tokenize = [[str(s).strip() for s in col] for col in to_tokenize]
            if self.do_lower_case:
                to_tokenize = [[s.lower() for s in col] for col in to_tokenize]
            tokenized = self.tokenizer(*to_tokenize, padding=True, truncation='longest_first', return_tensors="pt",
                                       max_length=self.max_seq_length)
        elif isinstance(texts[0], list):
            assert isinstance(texts[0][1], str)
            new_texts = []
            for s in texts:
                if self.do_lower_case:
                    new_texts.append([s[0], s[1].strip().lower()])
                else:
                    new_texts.append([s[0], s[1].strip()])
            texts = new_texts
            assert len(texts[0]) == 2, f'The input should have both instruction and input text'
            num = len(texts)
            contexts = []
            concatenated_input_texts = []
            for local_idx in range(num):
                assert len(texts[local_idx]) == 2
                contexts.append(texts[local_idx][0])
                concatenated_input_texts.append(''.join(texts[local_idx]))
                assert isinstance(contexts[-1], str)
                assert isinstance(concatenated_input_texts[-1], str)
            tokenized = self.tokenize(concatenated_input_texts)
            context_tok = self.tokenize(contexts)
            tokenized['context_masks'] = torch.sum(context_tok['attention_mask'], dim=1)
            tokenized['context_masks'] = tokenized['context_masks'] - 1
            for my_idx in range(len(tokenized['context_masks'])):
                if tokenized['context_masks'][my_idx] <= 1:
                    tokenized['context_masks'][my_idx] = 0
        else:
            raise ValueError('not support other modes')

        output.update(tokenized)
        return output


class INSTRUCTOR(nn.Sequential):
    # sentence_transformers.SentenceTransformer: an nn.Sequential of modules; tokenize goes to the first one
    def tokenize(self, texts):
        return self[0].tokenize(texts)

    @staticmethod
    def _text_length(text):
        if isinstance(text, dict):
            return len(next(iter(text.values())))
        elif not hasattr(text, '__len__'):
            return 1
        elif len(text) == 0 or isinstance(text[0], int):
            return len(text)
        else:
            return sum([len(t) for t in text])

    def encode(self, sentences, batch_size=32, convert_to_tensor=False, normalize_embeddings=False):
        self.eval()
        all_embeddings = []
        if isinstance(sentences[0], list):
            lengths = []
            for sen in sentences:
                lengths.append(-self._text_length(sen[1]))
            length_sorted_idx = np.argsort(lengths)
        else:
            length_sorted_idx = np.argsort([-self._text_length(sen) for sen in sentences])
        sentences_sorted = [sentences[idx] for idx in length_sorted_idx]

        for start_index in range(0, len(sentences), batch_size):
            sentences_batch = sentences_sorted[start_index:start_index + batch_size]
            features = self.tokenize(sentences_batch)

            with torch.no_grad():
                out_features = self.forward(features)
                embeddings = out_features['sentence_embedding']
                embeddings = embeddings.detach()
                if normalize_embeddings:
                    embeddings = torch.nn.functional.normalize(embeddings, p=2, dim=1)
            all_embeddings.extend(embeddings)

        all_embeddings = [all_embeddings[idx] for idx in np.argsort(length_sorted_idx)]
        if convert_to_tensor:
            all_embeddings = torch.stack(all_embeddings)
        return all_embeddings


def reference_embedding(encoder, tokenizer, instruction, text, normalize):
    # one example alone: no padding, no mask; mean of the hidden states after the instruction words
    ids = tokenizer.encode_one(instruction + text.strip())
    n_instruction = len(tokenizer.encode_one(instruction)) - 1  # words of the instruction, without its </s>
    skip = n_instruction if n_instruction > 1 else 0
    with torch.no_grad():
        hidden = encoder(input_ids=torch.tensor([ids]), return_dict=True).last_hidden_state[0]
    emb = hidden[skip:].mean(dim=0)
    if normalize:
        emb = emb / emb.norm()
    return emb


def main():
    sentences = [
        ["Represent the Science title: ", "3D ActivityNet: a dataset for parsing video into actions"],
        ["Represent the Wikipedia document for retrieval: ",
         "Capitalism has been dominant in the Western world since the end of feudalism and it is debated"],
        ["Represent the question for retrieving supporting documents: ", "where is the food stored in a yam plant"],
        ["Represent: ", "a short one"],
        ["Represent the Financial statement: ", "Revenue rose"],
    ]
    words = []
    for instruction, text in sentences:
        words += (instruction + text).split()
    tokenizer = WhitespaceT5Tokenizer(words)

    config = T5Config(vocab_size=len(tokenizer.vocab) + 2, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
                      feed_forward_proj="relu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    encoder = T5EncoderModel(config).eval()
    model = INSTRUCTOR(INSTRUCTOR_Transformer(encoder, tokenizer), INSTRUCTOR_Pooling(config.d_model))

    # one batch, to see the padding and the instruction spans the pooling works on
    features = model.tokenize([sentences[i] for i in (0, 4, 3)])
    assert not features['attention_mask'].all()
    assert features['context_masks'].tolist()[2] == 0 and features['context_masks'].tolist()[0] == 4

    for normalize in (False, True):
        emb = model.encode(sentences, batch_size=3, convert_to_tensor=True, normalize_embeddings=normalize)
        ref = torch.stack([reference_embedding(encoder, tokenizer, instr, text, normalize)
                           for instr, text in sentences])
        assert torch.allclose(emb, ref, atol=1e-5), (normalize, (emb - ref).abs().max())
    print(f"INSTRUCTOR encode() over {len(sentences)} padded [instruction, text] pairs == unpadded per-example "
          f"reference (max diff {(emb - ref).abs().max().item():.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
