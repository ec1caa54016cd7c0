// Evaluator of a parsed Program: jinja2 semantics (scoping of for/macro, Undefined, loop variables) with the
// environment transformers builds (tojson override, raise_exception, strftime_now, namespace, dict).
#pragma once
#include <string>

#include "loongforge/data/jinja/parser.h"
#include "loongforge/data/jinja/value.h"

namespace lf::data::jinja {

// Throws lf::Error "ORIGIN:LINE: what".
std::string render(const Program& prog, const Dict& context);

}  // namespace lf::data::jinja
