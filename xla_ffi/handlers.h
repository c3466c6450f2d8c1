// Declarations of every XLA FFI handler symbol in the extension (one line per target in
// targets.inc), so that module.cc can export them without knowing the handlers' files.
#pragma once

#include "xla/ffi/api/ffi.h"

#define MOONEP_TARGET(name, symbol) XLA_FFI_DECLARE_HANDLER_SYMBOL(symbol);
#include "xla_ffi/targets.inc"
#undef MOONEP_TARGET
