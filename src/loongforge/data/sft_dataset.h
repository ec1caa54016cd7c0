// Supervised fine-tuning samples from chat data (.jsonl), torch-free.
//
// Each line of a file is one conversation in one of three formats, detected per line:
//   alpaca   {"instruction", "input"?, "output", "system"?}  -> [system], user: instruction (+ "\n\n" + input), assistant
//   sharegpt {"conversations": [{"from": human|gpt|system (or user|assistant), "value"}...], "system"?}
//   openai   {"messages": [{"role": system|user|assistant, "content"}...]}
// Blank lines are skipped; every other line must be one of these with at least one assistant turn (lf::Error
// "FILE:LINE: field 'F': what" otherwise). A .json file holding a list (LLaVA's format) gives one conversation per
// element ("FILE:[i]" in errors). SftOptions::skip_bad: a conversation that would be such an error (invalid JSON, a
// missing field, markers and images that disagree, an image that cannot be read or decoded, too many tokens with its
// images, ...) is left out and counted instead (num_skipped(), first_skipped()); a file that cannot be opened, or a
// .json file that is not a list, stays an error.
//
// Images (vision-language models, SftOptions::image_token_id >= 0): a conversation's images are its top-level
// "image" / "images" (a path or a list; relative paths from image_root, else the data file's folder) with "<image>"
// markers in the text where they go (none: one "<image>\n" per image before the first user message), or image parts
// of OpenAI content lists ({"type": "image" | "image_url", "image" | "image_url": {"url"} | "path"}), passed to the
// template as {"type": "image"} next to {"type": "text", "text"}. Markers become image_placeholder before rendering;
// after tokenizing, each image_token_id is expanded to image_tokens(path) copies (never assistant). The number of
// markers must equal the number of images, and a conversation with images must fit seq_len + 1 tokens (one-line
// errors naming FILE:LINE otherwise). Every image is checked up front through image_tokens (which reads it): an
// image it cannot read is "FILE:LINE: field 'images[1]': PATH: why" (the field the image came from).
//
// A conversation is rendered with the chat template (add_generation_prompt=false; context: messages, tools=null,
// add_generation_prompt, bos_token, eos_token, as transformers' apply_chat_template) and encoded with
// add_special_tokens=false (the template writes BOS itself).
//
// Assistant mask: for assistant turn k, render(messages[:k], add_generation_prompt=true) is the text before the reply
// and render(messages[:k+1]) the text through its end; both must be prefixes of the full render ("chat template
// ORIGIN is not prefix-stable" otherwise). The characters between are assistant, including the template's
// end-of-turn token (<|im_end|>, <|eot_id|>, </s>) which the model must learn to emit, but excluding whitespace the
// template writes after that end-of-turn special token (ChatML's "\n" after <|im_end|>): generation stops at the
// special token, so that newline is never predicted. Character boundaries map to tokens by encoding the segments
// separately when their concatenation equals the encoding of the whole text (the usual case, boundaries being special
// tokens); otherwise per boundary by encoding the text before it (when that is a prefix of the ids) or by decoding
// prefixes of the ids; a token straddling a boundary counts as assistant (it overlaps the reply, as in transformers'
// return_assistant_tokens_mask).
//
// Labels are already shifted: position i holds input ids[i] and label ids[i+1] when token i+1 takes loss (an
// assistant token, or any token when assistant_only_loss is false), else -100; the last token of a conversation has
// label -100, as has padding. A conversation of n tokens takes n positions; one longer than seq_len takes seq_len
// positions and the token after them is only a label, so up to seq_len + 1 tokens lose nothing; longer ones are
// truncated to their first seq_len + 1 tokens (counted, one warning on stderr).
//
// Order: per epoch e the conversations are shuffled by (seed, e); the epochs form one stream that is packed greedily
// (in order, a conversation joins the current sequence when it fits, else the sequence is emitted padded and the
// conversation starts the next one). packing=false: one conversation per sequence. The dataset is a pure function of
// (options, data, position in the stream): state()/restore() resume exactly.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loongforge/data/chat_template.h"
#include "loongforge/data/tokenizer/tokenizer.h"

namespace lf::data {

struct SftOptions {
  std::vector<std::string> files;    // .jsonl files
  std::string chat_template;         // template source (ChatTemplate::load_from_folder(..).source or builtin(..))
  std::string template_origin = "chat_template";  // names the template in errors
  std::string bos_token, eos_token;  // passed to the template context
  int64_t seq_len = 2048;
  bool assistant_only_loss = true;   // false: loss on every token (except padding)
  bool packing = true;               // several conversations per sequence (per-document attention, restarting positions)
  uint64_t seed = 1234;              // shuffle order per epoch
  int64_t pad_id = -1;               // -1: the id of eos_token, else 0
  // Images (see above); image_token_id < 0: text only (image fields are an error).
  int64_t image_token_id = -1;
  std::string image_placeholder = "<image>";  // the text each <image> marker becomes (it must encode to image_token_id)
  std::function<int64_t(const std::string& path)> image_tokens;  // tokens an image takes
  std::string image_root;                                        // "" : each data file's folder
  bool skip_bad = false;  // leave bad conversations out (counted) instead of failing on the first
};

struct SftSample {  // one training sequence of exactly seq_len positions
  std::vector<int64_t> input_ids;     // padded with pad_id
  std::vector<int64_t> labels;        // next token, already shifted; -100 = no loss
  std::vector<int64_t> position_ids;  // restart at 0 at each packed conversation (and at the padding)
  std::vector<int64_t> segment_ids;   // 0,0,..,1,1,..: which packed conversation; padding gets its own id
  std::vector<std::string> images;    // the images of its image-token runs, in order
  std::vector<int64_t> image_tokens;  // the length of each image's run
  std::vector<int64_t> documents;     // the length of each packed conversation (the rest is padding)
  bool operator==(const SftSample&) const = default;
};

class SftDataset {
 public:
  // Reads, renders and tokenizes everything up front. Errors (lf::Error) name FILE:LINE and the field. TOK must
  // outlive the dataset.
  SftDataset(SftOptions opts, const Tokenizer& tok);

  SftSample next();
  // {"conversations_consumed", "samples", "seed", "seq_len", "packing", "num_conversations"}; restore refuses a state
  // of other options or data (lf::Error naming WHERE and the field).
  nlohmann::json state() const;
  void restore(const nlohmann::json& state, const std::string& where = "sft data state");

  size_t num_conversations() const { return convs_.size(); }
  size_t num_truncated() const { return truncated_; }
  size_t num_read() const { return read_; }        // conversations in the files, bad ones included
  size_t num_skipped() const { return skipped_; }  // bad conversations left out (skip_bad)
  const std::string& first_skipped() const { return first_skipped_; }  // the first one's error ("" : none)
  uint64_t epoch() const { return consumed_ / convs_.size(); }  // epoch of the next conversation
  int64_t pad_id() const { return pad_id_; }
  const SftOptions& options() const { return opts_; }

  // One conversation rendered + tokenized (unpacked, untruncated) with its loss mask: 1 on assistant tokens (every
  // token when assistant_only_loss is false).
  struct Encoded {
    std::string text;
    std::vector<int64_t> ids;
    std::vector<uint8_t> assistant_mask;
  };
  Encoded encode_conversation(size_t i) const;

  struct Message {
    std::string role;
    nlohmann::json content;  // a string, or a list of {"type": "text", "text"} / {"type": "image"} parts
  };

 private:
  struct Conv {
    std::string where;  // FILE:LINE
    std::vector<Message> messages;
    std::vector<std::string> images;  // in the order of their markers
    std::vector<std::string> image_fields;  // the field of each image, for errors
    std::vector<int64_t> image_tokens;  // each image's run of image tokens
    std::vector<int64_t> ids;  // truncated to seq_len + 1
    std::vector<uint8_t> mask;
  };
  // Parses, checks and tokenizes one conversation and appends it (nothing appended when it throws).
  void add_conversation(const nlohmann::json& j, const std::string& where, const std::string& image_root);
  size_t conv_at(uint64_t k);  // conversation index of stream position K
  void expand_images(Conv& c, Encoded& e) const;  // one image token per image -> its run (c.image_tokens)

  SftOptions opts_;
  ChatTemplate tmpl_;
  const Tokenizer* tok_;
  std::vector<Conv> convs_;
  int64_t pad_id_ = 0;
  size_t truncated_ = 0, read_ = 0, skipped_ = 0;
  std::string first_skipped_;
  uint64_t consumed_ = 0, samples_ = 0;
  uint64_t perm_epoch_ = UINT64_MAX;  // the epoch perm_ belongs to
  std::vector<uint32_t> perm_;
};

}  // namespace lf::data
