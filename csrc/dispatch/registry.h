#pragma once
#include "../kernels/common/kernel.h"

namespace fa2cpu {
const KernelTable& current_table();            // the family in use
const KernelTable* family_table(int isa);      // nullptr unless compiled and usable here
}  // namespace fa2cpu
