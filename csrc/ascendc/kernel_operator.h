// The one include of every kernel, as in AscendC.
#pragma once
#include "dtype.h"
#include "error.h"
#include "runtime.h"
#include "soc.h"
#include "tensor.h"
#include "vec.h"
