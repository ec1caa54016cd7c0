// The robot-policy family's registry entry: LeRobot's policies, picked by the config's `type` (ACT, ...).
#pragma once
#include "loongforge/models/registry.h"

namespace lf::models::policy {

Family family();

}  // namespace lf::models::policy
