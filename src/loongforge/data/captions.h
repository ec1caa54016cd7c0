// Caption files of media folders for diffusion training: FOLDER/metadata.jsonl, one JSON object per line mapping a
// file of the folder to its caption, as Hugging Face's imagefolder / videofolder metadata (and diffusers' training
// scripts) use it: the file under "file_name" (or "file"), relative to the folder (subfolders allowed, "./" and
// "a/../" folded), the caption under "text" (or "caption"); other keys are ignored, blank lines skipped.
// Every error is one line naming the jsonl file, the line and the field ("FOLDER/metadata.jsonl:3: field 'text':
// missing"); a media file without a caption names the jsonl file and the media file.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace lf::data {

inline constexpr const char* kCaptionFile = "metadata.jsonl";

struct CaptionEntry {
  std::string file;  // relative to the folder, normalised ("a/b.mp4")
  std::string text;
  int64_t line = 0;  // 1-based line of the jsonl file
  std::string file_key = "file_name";  // the key that named the file ("file_name" or "file")
};

// Parses a captions jsonl file. Errors: bad JSON or not an object on line N; no file key or no caption key, or one
// that is not a string; an empty or absolute file name, or one that leaves the folder ("../x"); a file listed twice.
std::vector<CaptionEntry> read_captions(const std::string& jsonl_path);

// The file name as read_captions stores it (relative, lexically normal, '/' separators); "" when it leaves the folder
// or is absolute.
std::string normalize_caption_path(const std::string& relative);

// The captions of a folder's media files: reads FOLDER/metadata.jsonl (read_captions), checks that every file it
// lists exists under FOLDER ("...:N: field 'file_name': FILE does not exist") and that each of MEDIA (paths relative
// to FOLDER) has a caption ("FOLDER/metadata.jsonl: no caption for FILE"). Returns relative path -> caption, for
// MEDIA's files (normalised as read_captions' names).
std::map<std::string, std::string> folder_captions(const std::string& folder, const std::vector<std::string>& media);

// Whether FOLDER has a metadata.jsonl.
bool has_captions(const std::string& folder);

}  // namespace lf::data
