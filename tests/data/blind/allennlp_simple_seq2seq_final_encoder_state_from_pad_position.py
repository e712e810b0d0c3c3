# allenai/allennlp#1713 ("possible masking bug in simple_seq2seq"), fixed by allenai/allennlp#1808
# (commit 546242fd4, "Fixes for seq2seq model").
# SimpleSeq2Seq seeded its LSTMCell decoder with `encoder_outputs[:, -1]`: on a right-padded source
# batch the masked PytorchSeq2SeqWrapper returns zeros at pad positions, so every shorter source
# started decoding from a zero state instead of its last real token's state.
# The fix takes the state at each row's last real token: util.get_final_encoder_states(encoder_outputs,
# source_mask, bidirectional), which gathers at index mask.sum(1) - 1.
# Ported (trimmed) from allennlp/models/encoder_decoders/simple_seq2seq.py and allennlp/nn/util.py
# at 546242fd4^ / 546242fd4: the training forward with gold targets and dot-product attention.
import sys

import torch
import torch.nn.functional as F
from torch.nn import LSTM, Embedding, Linear, LSTMCell
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

FIXED = "--fixed" in sys.argv


# ---- allennlp/nn/util.py (trimmed) ----
def get_text_field_mask(text_field_tensors):
    tokens = text_field_tensors["tokens"]
    return (tokens != 0).long()


def get_lengths_from_binary_sequence_mask(mask):
    return mask.long().sum(-1)


def masked_softmax(vector, mask):
    if mask is None:
        return F.softmax(vector, dim=-1)
    mask = mask.float()
    while mask.dim() < vector.dim():
        mask = mask.unsqueeze(1)
    result = F.softmax(vector * mask, dim=-1)
    result = result * mask
    result = result / (result.sum(dim=-1, keepdim=True) + 1e-13)
    return result


def weighted_sum(matrix, attention):
    return attention.unsqueeze(1).bmm(matrix).squeeze(1)


def get_final_encoder_states(encoder_outputs, mask, bidirectional=False):
    last_word_indices = mask.sum(1).long() - 1
    batch_size, _, encoder_output_dim = encoder_outputs.size()
    expanded_indices = last_word_indices.view(-1, 1, 1).expand(batch_size, 1, encoder_output_dim)
    final_encoder_output = encoder_outputs.gather(1, expanded_indices)
    final_encoder_output = final_encoder_output.squeeze(1)
    if bidirectional:
        final_forward_output = final_encoder_output[:, :(encoder_output_dim // 2)]
        final_backward_output = encoder_outputs[:, 0, (encoder_output_dim // 2):]
        final_encoder_output = torch.cat([final_forward_output, final_backward_output], dim=-1)
    return final_encoder_output


def sequence_cross_entropy_with_logits(logits, targets, weights):
    logits_flat = logits.view(-1, logits.size(-1))
    log_probs_flat = F.log_softmax(logits_flat, dim=-1)
    targets_flat = targets.view(-1, 1).long()
    negative_log_likelihood_flat = -torch.gather(log_probs_flat, dim=1, index=targets_flat)
    negative_log_likelihood = negative_log_likelihood_flat.view(*targets.size())
    negative_log_likelihood = negative_log_likelihood * weights.float()
    per_batch_loss = negative_log_likelihood.sum(1) / (weights.sum(1).float() + 1e-13)
    return per_batch_loss.sum() / ((weights.sum(1) > 0).float().sum() + 1e-13)


# ---- PytorchSeq2SeqWrapper around an LSTM (pack by lengths, pad outputs with zeros) ----
class PytorchSeq2SeqWrapper(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self._module = module

    def is_bidirectional(self):
        return self._module.bidirectional

    def get_output_dim(self):
        return self._module.hidden_size * (2 if self.is_bidirectional() else 1)

    def forward(self, inputs, mask):
        total_length = inputs.size(1)
        lengths = get_lengths_from_binary_sequence_mask(mask)
        packed = pack_padded_sequence(inputs, lengths.cpu(), batch_first=True, enforce_sorted=False)
        packed_out, _ = self._module(packed)
        out, _ = pad_packed_sequence(packed_out, batch_first=True, total_length=total_length)
        return out


class DotProductAttention(torch.nn.Module):
    """LegacyAttention(DotProductSimilarity()) with normalize=True."""

    def forward(self, vector, matrix, matrix_mask=None):
        similarities = torch.bmm(matrix, vector.unsqueeze(-1)).squeeze(-1)
        return masked_softmax(similarities, matrix_mask)


# ---- allennlp/models/encoder_decoders/simple_seq2seq.py (trimmed) ----
class SimpleSeq2Seq(torch.nn.Module):
    def __init__(self, num_source, num_classes, embed_dim, encoder, start_index,
                 target_embedding_dim=None, scheduled_sampling_ratio=0.0, use_attention=True):
        super().__init__()
        self._source_embedder = Embedding(num_source, embed_dim, padding_idx=0)
        self._encoder = encoder
        self._start_index = start_index
        self._scheduled_sampling_ratio = scheduled_sampling_ratio
        self._max_decoding_steps = 6
        self._encoder_output_dim = self._encoder.get_output_dim()
        self._decoder_output_dim = self._encoder_output_dim
        target_embedding_dim = target_embedding_dim or embed_dim
        self._target_embedder = Embedding(num_classes, target_embedding_dim)
        self._attention_function = use_attention
        if self._attention_function:
            self._decoder_attention = DotProductAttention()
            self._decoder_input_dim = self._encoder_output_dim + target_embedding_dim
        else:
            self._decoder_input_dim = target_embedding_dim
        self._decoder_cell = LSTMCell(self._decoder_input_dim, self._decoder_output_dim)
        self._output_projection_layer = Linear(self._decoder_output_dim, num_classes)

    def forward(self, source_tokens, target_tokens=None):
        embedded_input = self._source_embedder(source_tokens["tokens"])
        batch_size, _, _ = embedded_input.size()
        source_mask = get_text_field_mask(source_tokens)
        encoder_outputs = self._encoder(embedded_input, source_mask)
        if FIXED:
            final_encoder_output = get_final_encoder_states(
                encoder_outputs, source_mask, self._encoder.is_bidirectional())
        else:
            final_encoder_output = encoder_outputs[:, -1]  # (batch_size, encoder_output_dim)
        if target_tokens:
            targets = target_tokens["tokens"]
            target_sequence_length = targets.size()[1]
            num_decoding_steps = target_sequence_length - 1
        else:
            num_decoding_steps = self._max_decoding_steps
        decoder_hidden = final_encoder_output
        decoder_context = encoder_outputs.new_zeros(batch_size, self._decoder_output_dim)
        last_predictions = None
        step_logits = []
        step_predictions = []
        for timestep in range(num_decoding_steps):
            if self.training and torch.rand(1).item() >= self._scheduled_sampling_ratio:
                input_choices = targets[:, timestep]
            else:
                if timestep == 0:
                    input_choices = source_mask.new_full((batch_size,), fill_value=self._start_index)
                else:
                    input_choices = last_predictions
            decoder_input = self._prepare_decode_step_input(input_choices, decoder_hidden,
                                                            encoder_outputs, source_mask)
            decoder_hidden, decoder_context = self._decoder_cell(decoder_input,
                                                                 (decoder_hidden, decoder_context))
            output_projections = self._output_projection_layer(decoder_hidden)
            step_logits.append(output_projections.unsqueeze(1))
            class_probabilities = F.softmax(output_projections, dim=-1)
            _, predicted_classes = torch.max(class_probabilities, 1)
            last_predictions = predicted_classes
            step_predictions.append(last_predictions.unsqueeze(1))
        logits = torch.cat(step_logits, 1)
        all_predictions = torch.cat(step_predictions, 1)
        output_dict = {"logits": logits, "predictions": all_predictions}
        if target_tokens:
            target_mask = get_text_field_mask(target_tokens)
            output_dict["loss"] = self._get_loss(logits, targets, target_mask)
        return output_dict

    def _prepare_decode_step_input(self, input_indices, decoder_hidden_state=None,
                                   encoder_outputs=None, encoder_outputs_mask=None):
        embedded_input = self._target_embedder(input_indices)
        if self._attention_function:
            encoder_outputs_mask = encoder_outputs_mask.float()
            input_weights = self._decoder_attention(decoder_hidden_state, encoder_outputs,
                                                    encoder_outputs_mask)
            attended_input = weighted_sum(encoder_outputs, input_weights)
            return torch.cat((attended_input, embedded_input), -1)
        return embedded_input

    @staticmethod
    def _get_loss(logits, targets, target_mask):
        relevant_targets = targets[:, 1:].contiguous()
        relevant_mask = target_mask[:, 1:].contiguous()
        return sequence_cross_entropy_with_logits(logits, relevant_targets, relevant_mask)


def main():
    torch.manual_seed(0)
    vocab, start, end = 20, 2, 3
    encoder = PytorchSeq2SeqWrapper(LSTM(16, 16, batch_first=True))
    model = SimpleSeq2Seq(vocab, vocab, 16, encoder, start_index=start)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    # A copy task, right-padded with 0 (the "@@PADDING@@" index) as allennlp's TextField does.
    source = torch.tensor([[5, 6, 7, 8, 9, 10],
                           [11, 12, 13, 0, 0, 0],
                           [14, 15, 0, 0, 0, 0]])
    target = torch.tensor([[start, 5, 6, 7, 8, 9, 10, end],
                           [start, 11, 12, 13, end, 0, 0, 0],
                           [start, 14, 15, end, 0, 0, 0, 0]])
    model.train()
    for step in range(30):
        optimizer.zero_grad()
        out = model({"tokens": source}, {"tokens": target})
        out["loss"].backward()
        optimizer.step()
        if step % 10 == 0:
            print(f"step {step} loss {out['loss'].item():.4f}")
    print("final loss", round(out["loss"].item(), 4))
    print("predictions", out["predictions"].tolist())


if __name__ == "__main__":
    main()
