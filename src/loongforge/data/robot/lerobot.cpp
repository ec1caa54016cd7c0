// Placeholder until this format's reader lands (being written now); the helper replaces this whole file.
#include "loongforge/core/error.h"
#include "loongforge/data/robot/dataset.h"

namespace lf::data::robot {

std::unique_ptr<RobotDataset> open_lerobot_dataset(const std::string& folder) {
  throw Error(folder + ": this build cannot read this dataset format yet");
}

}  // namespace lf::data::robot
