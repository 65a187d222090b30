// The two OpenMP calls the kernels make, declared here rather than taken from <omp.h>: Apple's
// clang has no OpenMP of its own, and the build (loom/kernels/build.py) links the runtime
// torch ships (libomp.dylib in torch/lib, libgomp here) without its header. A compiler
// with no OpenMP at all builds the kernels without it: the pragmas are then ignored and
// every parallel region is the one calling thread, which these stand-ins say.
#ifndef LOOM_OMP_H
#define LOOM_OMP_H

#ifdef _OPENMP
int omp_get_thread_num(void);
int omp_get_num_threads(void);
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

#endif
