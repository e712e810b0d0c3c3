# huggingface/optimum PR #1076 (commit b4b9b77, fixes optimum#775): TextSeq2SeqOnnxConfig.inputs popped
# "attention_mask" for the decoder export, so the exported ONNX decoder has no encoder_attention_mask input
# and its cross-attention attends to the padded encoder positions of a padded batch.
import sys
import torch
from transformers import T5Config, T5ForConditionalGeneration

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ConfigBehavior:
    MONOLITH = "monolith"
    ENCODER = "encoder"
    DECODER = "decoder"


class TextSeq2SeqOnnxConfig:
    """Trimmed from optimum/exporters/onnx/config.py (use_past=False decoder)."""

    def __init__(self, behavior, use_past_in_inputs=False):
        self._behavior = behavior
        self.use_past_in_inputs = use_past_in_inputs

    @property
    def torch_to_onnx_input_map(self):
        if self._behavior is ConfigBehavior.DECODER:
            return {
                "decoder_input_ids": "input_ids",
                "encoder_outputs": "encoder_hidden_states",
                "attention_mask": "encoder_attention_mask",
            }
        return {}

    @property
    def inputs(self):
        common_inputs = {}
        if self._behavior is not ConfigBehavior.DECODER:
            common_inputs["input_ids"] = {0: "batch_size", 1: "encoder_sequence_length"}

        common_inputs["attention_mask"] = {0: "batch_size", 1: "encoder_sequence_length"}

        if self._behavior is not ConfigBehavior.ENCODER:
            if not FIXED:
                # TODO: it is likely this pop() is unwanted as we then always hit
                # https://github.com/huggingface/transformers/blob/v4.26.0/src/transformers/models/t5/modeling_t5.py#L965-L969
                common_inputs.pop("attention_mask")

            if self.use_past_in_inputs:
                common_inputs["decoder_input_ids"] = {0: "batch_size"}
            else:
                common_inputs["decoder_input_ids"] = {0: "batch_size", 1: "decoder_sequence_length"}

        if self._behavior is ConfigBehavior.DECODER:
            common_inputs["encoder_outputs"] = {0: "batch_size", 1: "encoder_sequence_length"}

        return common_inputs

    def ordered_onnx_input_names(self):
        return [self.torch_to_onnx_input_map.get(n, n) for n in self.inputs]


class ExportedDecoderSession:
    """Stands in for the ONNX graph exported with input_names=config.inputs: a torch input that is not a
    graph input is traced as absent (None), exactly like torch.onnx.export(model, (dummy_inputs,))."""

    def __init__(self, model, config):
        self.model = model
        self.onnx_to_torch = {v: k for k, v in config.torch_to_onnx_input_map.items()}
        self.input_names = config.ordered_onnx_input_names()

    def run(self, onnx_inputs):
        kwargs = {self.onnx_to_torch.get(n, n): onnx_inputs[n] for n in self.input_names}
        kwargs["encoder_outputs"] = (kwargs["encoder_outputs"],)
        with torch.no_grad():
            return self.model(**kwargs, use_cache=False).logits


class ORTDecoder:
    """Trimmed from optimum/onnxruntime/base.py ORTDecoderForSeq2Seq.forward (use_torch branch)."""

    def __init__(self, session):
        self.session = session
        self.input_names = session.input_names

    def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask=None):
        onnx_inputs = {"input_ids": input_ids}
        # Add the encoder_attention_mask inputs when needed
        if "encoder_attention_mask" in self.input_names:
            onnx_inputs["encoder_attention_mask"] = encoder_attention_mask
        # Add the encoder_hidden_states inputs when needed
        if "encoder_hidden_states" in self.input_names:
            onnx_inputs["encoder_hidden_states"] = encoder_hidden_states
        return self.session.run(onnx_inputs)


cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
model = T5ForConditionalGeneration(cfg).eval()

decoder_config = TextSeq2SeqOnnxConfig(ConfigBehavior.DECODER)
print("exported decoder inputs:", decoder_config.ordered_onnx_input_names())
decoder = ORTDecoder(ExportedDecoderSession(model, decoder_config))

# right-padded batch, as the tokenizer produces it
input_ids = torch.tensor([[5, 9, 13, 22, 7, 31, 40, 1], [8, 17, 3, 1, 0, 0, 0, 0]])
attention_mask = (input_ids != 0).long()
with torch.no_grad():
    encoder_hidden_states = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

# greedy decode with the exported (no-past) decoder, and with the PyTorch model as the reference
dec = torch.zeros(2, 1, dtype=torch.long)
max_diff = 0.0
for _ in range(6):
    ort_logits = decoder.forward(dec, encoder_hidden_states, attention_mask)
    with torch.no_grad():
        ref_logits = model(attention_mask=attention_mask, encoder_outputs=(encoder_hidden_states,),
                           decoder_input_ids=dec, use_cache=False).logits
    max_diff = max(max_diff, (ort_logits - ref_logits).abs().max().item())
    dec = torch.cat([dec, ref_logits[:, -1:].argmax(-1)], dim=1)

print(f"max |exported decoder logits - PyTorch logits| over padded batch: {max_diff:.6f}")
