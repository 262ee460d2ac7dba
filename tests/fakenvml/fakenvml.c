/*
 * fakenvml: a fake libnvidia-ml.so.1 for GPU-free tests of the real pynvml code path.
 *
 * Build (tests/fakenvml/build.py does this):
 *   cc -shared -fPIC -O2 -Wall -Werror -Wl,-soname,libnvidia-ml.so.1 fakenvml.c \
 *      -o libnvidia-ml.so.1 -lpthread
 * ABI proof: the same file compiles with -DFAKENVML_REAL_NVML_H -I<dir of NVIDIA's nvml.h>;
 * every function definition then must match NVIDIA's prototype, and the static asserts below
 * pin struct sizes, offsets and constants to the values pynvml's ctypes structs use.
 * Driver branches (-DFAKENVML_DRIVER=<major * 1000 + minor>, build_fake(..., driver=...)): the
 * library of an older driver exports exactly the entry points of this file that the nvml.h of
 * that release declares, and fills process entries of the size that header gives (see the
 * FK_HAS_* switches below, build.py DRIVERS and docs/sampling.md "Driver branches"); pynvml
 * then finds no such symbol (FUNCTION_NOT_FOUND). Unset: the newest driver, every export.
 *
 * Scenario file: named by $FAKE_NVML_SCENARIO (no variable: one default GPU). Re-read when its
 * inode, size or mtime changes (checked at most every 10 ms, and at every nvmlInit*; tests can
 * force it with fakenvml_reload()). A reload keeps t0 only when the file sets it, and restarts
 * the per-call counters that fail/delay rules use. A file that does not parse keeps the
 * previous scenario (the error goes to stderr and fakenvml_last_error()); at init it fails
 * nvmlInit with NVML_ERROR_UNKNOWN.
 *
 *   # comment; one "key = value" per line; later lines win
 *   devices = 2                       # GPU count, 0..64 (default 1); may change on reload
 *                                     # (hot-plug): handles keep their index, one past the
 *                                     # count gives INVALID_ARGUMENT
 *   t0 = 1764410000.25                # time origin, Unix s, for ramps, steps, from=/to= and
 *                                     # xid @T (default: when the file was loaded)
 *   driver_version = 550.54.15
 *   cuda_driver_version = 12040       # as NVML returns it: 1000*major + 10*minor
 *   nvml_version = 12.550.54.15
 *   gpu.<i|*>.<field> = VALUE         # per GPU (i) or all GPUs (*)
 *   mig.<i>.<j>.<field> = VALUE       # MIG device j (0..6) of GPU i (see MIG below)
 *   fail.<symbol|*>[.<i|*>] = CODE [after=N] [until=N] [every=N] [from=S] [to=S]
 *   delay.<symbol|*>[.<i|*>] = MS [after=N] [until=N] [every=N] [from=S] [to=S]
 *
 * String fields: name, uuid, pci_bus_id, serial, vbios, up to 255 bytes (longer than NVML's 96-byte buffers:
 *   a longer one gives INSUFFICIENT_SIZE to pynvml); \xNN stands for any byte but NUL (names
 *   that are not UTF-8), \\ for a backslash, any other escape is an error.
 * Number fields (VALUE below), NVML's own units:
 *   memory.total, memory.used (bytes; "used" as in nvmlMemory_t, i.e. including reserved; it
 *   may exceed total, as some drivers report, and "free" is then 0), memory.reserved; util.gpu, util.memory, util.encoder, util.decoder (%); temperature (C);
 *   power.usage, power.limit (mW); energy (mJ); clock.graphics, clock.sm, clock.mem,
 *   clock.video (MHz); pcie.tx, pcie.rx (KB/s); ecc.corrected, ecc.uncorrected (volatile
 *   totals); mig, mig.pending (0/1); clocks_event_reasons, supported_events (bitmasks, 0x ok);
 *   temperature.shutdown, temperature.slowdown (C; nvmlDeviceGetTemperatureThreshold).
 * VALUE:
 *   42                constant
 *   1e9+2e6/s         ramp: 1e9 + 2e6 * (seconds since t0); "-" slopes too
 *   steps 0:10 30:50+1/s 60:20
 *                     piecewise: segment i from T_i seconds after t0 (a ramp in a segment
 *                     counts from its T_i); before the first T, the first segment
 * List fields:
 *   processes = PID:USED[:CC] ...     compute processes (two-call protocol); USED is bytes,
 *                                     a ramp, or "na" (NVML_VALUE_NOT_AVAILABLE, 2^64-1); CC the
 *                                     CC protected bytes (default 0; "na"), in 32-byte entries
 *   graphics_processes, mps_processes = PID:USED ...   the graphics and MPS-client lists
 *   process_util = PID:SM:MEM[:ENC:DEC] ...   one sample per period per PID (%)
 *   process_util.period_ms = 1000     the newest sample is stamped t0 + a whole number of
 *                                     periods (µs); lastSeenTimeStamp >= it gives NOT_FOUND
 *   process_util.offset_ms = 0        VALUE added to every sample stamp (a skewed clock)
 *   xid = CODE[@S] ...                Xid events, pending from S seconds after t0 (default 0),
 *                                     each delivered once by nvmlEventSetWait_v2 to sets that
 *                                     registered type 0x8 on that GPU; delivery state survives
 *                                     reloads of the same path, so appending delivers only new
 *
 * MIG: "mig.N.I.<field> = value" (N a GPU index, I 0..6, no wildcards) declares MIG device I of
 * GPU N; any line for mig.N.I creates it. It is reachable while gpu.N.mig evaluates to 1 (MIG
 * mode); with mig 0 the GPU behaves as if no mig.N.* line existed. Fields:
 *   uuid                default MIG-<N as %08x>-<I as %04x>-4000-8000-000000000000
 *   name                default: the GPU's name + " MIG"
 *   memory.total        VALUE, bytes (default 10737418240)
 *   memory.used         VALUE (default 0; "used" as for GPUs, i.e. including reserved)
 *   memory.reserved     VALUE (default 0)
 *   processes, graphics_processes, mps_processes = PID:USED ...   as for GPUs
 *   gi, ci              GPU / compute instance id (default I + 1 and 0)
 * A GPU in MIG mode: nvmlDeviceGetMaxMigDeviceCount gives 7 (else 0);
 * nvmlDeviceGetMigDeviceHandleByIndex(I) gives I's handle, NOT_FOUND for an undeclared I,
 * INVALID_ARGUMENT for I >= the max count (always with MIG off); nvmlDeviceGetUtilizationRates
 * and nvmlDeviceGetProcessUtilization give NOT_SUPPORTED; its three process lists are the
 * union of its MIG devices' lists in index order (gpu.N.processes etc. are not used then);
 * everything else reads gpu.N.* as before. Outside MIG mode process entries carry instance
 * ids 0xFFFFFFFF; entries of a MIG device's list carry its gi/ci, on either handle.
 * A MIG handle: a fixed address per (N, I), distinct from GPU handles and the same across
 * reloads. It serves nvmlDeviceGetUUID, GetName, GetMemoryInfo(_v2), the three
 * Get*RunningProcesses (each version) and GetRunningProcessDetailList, GetGpuInstanceId / GetComputeInstanceId (gi / ci),
 * GetDeviceHandleFromMigDeviceHandle (the GPU's handle) and IsMigDeviceHandle (1; 0 for a GPU
 * handle); the instance-id and parent functions give INVALID_ARGUMENT for a GPU handle.
 * GetMaxMigDeviceCount and GetMigDeviceHandleByIndex give INVALID_ARGUMENT for a MIG handle,
 * and every other device function NOT_SUPPORTED. Once its MIG device is gone (a reload removed
 * the mig.N.I lines, set gpu.N.mig to 0 or dropped GPU N), every call with it gives NOT_FOUND.
 * Calls with a MIG handle count, and match rules, as calls on GPU N.
 *
 * Rules: <symbol> is the exported NVML name (nvmlDeviceGetPowerUsage) or * (every symbol).
 * Without a GPU part a rule matches every call of the symbol; with one, only calls on that GPU
 * (nvmlDeviceGetHandleByIndex_v2 counts as a call on GPU <index>, a call with a MIG handle as
 * one on its parent GPU). Call k (1-based, per symbol and GPU, since the last reload) matches
 * when k > after, k <= until (if set), (k - after) % every == 0 (if set) and
 * from <= now-t0 < to (if set). The first matching fail
 * rule and the first matching delay rule apply: the call sleeps MS milliseconds (without
 * holding any lock: a hung call), then returns CODE. CODE is an NVML error name without the
 * NVML_ERROR_ prefix (GPU_IS_LOST, NOT_SUPPORTED, TIMEOUT, DRIVER_NOT_LOADED, ...), a number,
 * ABORT (the process aborts, like a driver crash) or SEGV (it faults on a NULL write).
 *
 * Extra exports for tests (ctypes): fakenvml_call_count(symbol) (all GPUs; "*" = all symbols),
 * fakenvml_call_count_dev(symbol, gpu) (gpu -1 = calls without a device), fakenvml_reset_counts(),
 * fakenvml_reload() (0 or -1), fakenvml_last_error(). With $FAKE_NVML_STATS set, the counts are
 * written there ("symbol gpu count" lines) when the last nvmlShutdown runs and at exit.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The driver release whose export set this build has (major * 1000 + minor of the first
 * release with it), and what that set holds, from NVIDIA's nvml.h of each release. */
#ifndef FAKENVML_DRIVER
#define FAKENVML_DRIVER 999999
#endif
/* 510.39.01: the _v3 process lists and nvmlDeviceGetMemoryInfo_v2 */
#define FK_HAS_V3_LISTS \
    (FAKENVML_DRIVER >= 510039 && !(FAKENVML_DRIVER >= 535098 && FAKENVML_DRIVER < 535104))
#define FK_HAS_MEMORY_V2 (FAKENVML_DRIVER >= 510039)
/* 535.43.02: the "clocks event" name, nvmlDeviceGetConfComputeMemSizeInfo, and _v3 entries of
 * 32 bytes (nvmlProcessInfo_t gained usedGpuCcProtectedMemory without a version bump) through
 * 535.86.x; 535.98 dropped the _v3 lists and the field; 535.104.05 brought _v3 back with
 * 24-byte entries and moved the field to nvmlDeviceGetRunningProcessDetailList's entries. */
#define FK_HAS_CLOCKS_EVENT (FAKENVML_DRIVER >= 535043)
#define FK_HAS_CONF_COMPUTE (FAKENVML_DRIVER >= 535043)
#define FK_V3_CC_ENTRY (FAKENVML_DRIVER >= 535043 && FAKENVML_DRIVER < 535098)
#define FK_HAS_DETAIL_LIST (FAKENVML_DRIVER >= 535104)
/* 565.57.01: nvmlDeviceGetTemperatureV */
#define FK_HAS_TEMPERATURE_V (FAKENVML_DRIVER >= 565057)

#ifdef FAKENVML_REAL_NVML_H
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>
/* Error codes newer than an older branch's first nvml.h, as the numbers later headers give
 * them (the current build takes them from the header, which the error table then checks). */
#if FAKENVML_DRIVER < 520056
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH ((nvmlReturn_t)25)
#endif
#if FAKENVML_DRIVER < 535043
#define NVML_ERROR_NOT_READY ((nvmlReturn_t)27)
#endif
#if FAKENVML_DRIVER < 545023
#define NVML_ERROR_GPU_NOT_FOUND ((nvmlReturn_t)28)
#endif
#else
#include "fakenvml_types.h"
#endif

#define EXPORT __attribute__((visibility("default")))

/* ---- ABI pins: the numbers pynvml's ctypes structs use (checked against nvml.h too) ---- */
_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t");
#if FK_HAS_MEMORY_V2
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t");
_Static_assert(offsetof(nvmlMemory_v2_t, total) == 8, "nvmlMemory_v2_t.total");
_Static_assert(offsetof(nvmlMemory_v2_t, used) == 32, "nvmlMemory_v2_t.used");
_Static_assert(nvmlMemory_v2 == 0x02000028, "nvmlMemory_v2 version word");
#endif
_Static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t");
#if FK_HAS_TEMPERATURE_V
_Static_assert(sizeof(nvmlTemperature_v1_t) == 12, "nvmlTemperature_v1_t");
_Static_assert(offsetof(nvmlTemperature_v1_t, temperature) == 8, "temperature offset");
#endif
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t");
_Static_assert(offsetof(nvmlPciInfo_t, busId) == 36, "nvmlPciInfo_t.busId");
/* Process entries: the unversioned lists' (v1), the _v2 lists' (the nvml.h of releases without
 * _v3 lists, before 510.39.01 and 535.98, names it nvmlProcessInfo_t), the _v3 lists'
 * (nvmlProcessInfo_t: 24 bytes, 32 in 535.43.02-535.86.x) and the process detail list's. */
#if FK_HAS_V3_LISTS
#define FK_V2_ENTRY nvmlProcessInfo_v2_t
#else
#define FK_V2_ENTRY nvmlProcessInfo_t
#endif
#define FK_V3_ENTRY_SIZE (FK_V3_CC_ENTRY ? 32 : 24)
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t");
_Static_assert(offsetof(nvmlProcessInfo_v1_t, usedGpuMemory) == 8, "v1 usedGpuMemory offset");
_Static_assert(sizeof(FK_V2_ENTRY) == 24, "the _v2 lists' entry");
_Static_assert(offsetof(FK_V2_ENTRY, usedGpuMemory) == 8, "usedGpuMemory offset");
_Static_assert(offsetof(FK_V2_ENTRY, computeInstanceId) == 20, "computeInstanceId");
_Static_assert(sizeof(nvmlProcessInfo_t) == FK_V3_ENTRY_SIZE, "nvmlProcessInfo_t (_v3 entry)");
#if FK_V3_CC_ENTRY
_Static_assert(offsetof(nvmlProcessInfo_t, usedGpuCcProtectedMemory) == 24, "CC memory offset");
#endif
#if FK_HAS_DETAIL_LIST
_Static_assert(sizeof(nvmlProcessDetail_v1_t) == 32, "nvmlProcessDetail_v1_t");
_Static_assert(offsetof(nvmlProcessDetail_v1_t, usedGpuCcProtectedMemory) == 24, "CC offset");
_Static_assert(sizeof(nvmlProcessDetailList_v1_t) == 24, "nvmlProcessDetailList_v1_t");
_Static_assert(nvmlProcessDetailList_v1 == 0x01000018, "nvmlProcessDetailList_v1 version");
#endif
#if FK_HAS_CONF_COMPUTE
_Static_assert(sizeof(nvmlConfComputeMemSizeInfo_t) == 16, "nvmlConfComputeMemSizeInfo_t");
#endif
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "process utilization sample");
_Static_assert(offsetof(nvmlProcessUtilizationSample_t, timeStamp) == 8, "timeStamp offset");
_Static_assert(offsetof(nvmlProcessUtilizationSample_t, decUtil) == 28, "decUtil offset");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t");
_Static_assert(offsetof(nvmlEventData_t, eventData) == 16, "eventData offset");
_Static_assert(nvmlEventTypeXidCriticalError == 0x8, "Xid event type");
_Static_assert(NVML_ERROR_GPU_IS_LOST == 15 && NVML_ERROR_NOT_SUPPORTED == 3 &&
                   NVML_ERROR_TIMEOUT == 10 && NVML_ERROR_DRIVER_NOT_LOADED == 9 &&
                   NVML_ERROR_INSUFFICIENT_SIZE == 7 && NVML_ERROR_NOT_FOUND == 6 &&
                   NVML_ERROR_UNKNOWN == 999,
               "error codes");

#define FK_MAX_GPUS 64
#define FK_MAX_SEG 8
#define FK_MAX_RULES 128
#define FK_MAX_XID 64
#define FK_MAX_SETS 32
#define FK_MAX_MIG 7 /* MIG devices per GPU (nvmlDeviceGetMaxMigDeviceCount in MIG mode) */
#define FK_NO_INSTANCE 0xFFFFFFFFU /* gpuInstanceId/computeInstanceId outside MIG mode */
#define FK_NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL

/* Every exported NVML symbol, for call counting and rules. */
#define FK_SYMBOLS(X)                                                                             \
    X(nvmlInit_v2) X(nvmlInitWithFlags) X(nvmlShutdown) X(nvmlErrorString)                        \
    X(nvmlSystemGetDriverVersion) X(nvmlSystemGetNVMLVersion) X(nvmlSystemGetCudaDriverVersion)   \
    X(nvmlSystemGetCudaDriverVersion_v2) X(nvmlDeviceGetCount_v2) X(nvmlDeviceGetHandleByIndex_v2) \
    X(nvmlDeviceGetHandleByUUID) X(nvmlDeviceGetIndex) X(nvmlDeviceGetName) X(nvmlDeviceGetUUID)   \
    X(nvmlDeviceGetPciInfo_v3) X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2)            \
    X(nvmlDeviceGetUtilizationRates) X(nvmlDeviceGetEncoderUtilization)                           \
    X(nvmlDeviceGetDecoderUtilization) X(nvmlDeviceGetTemperature) X(nvmlDeviceGetTemperatureV)   \
    X(nvmlDeviceGetPowerUsage) X(nvmlDeviceGetEnforcedPowerLimit)                                 \
    X(nvmlDeviceGetTotalEnergyConsumption) X(nvmlDeviceGetClockInfo)                              \
    X(nvmlDeviceGetPcieThroughput) X(nvmlDeviceGetTotalEccErrors) X(nvmlDeviceGetMigMode)         \
    X(nvmlDeviceGetCurrentClocksEventReasons) X(nvmlDeviceGetComputeRunningProcesses_v3)          \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3) X(nvmlDeviceGetMPSComputeRunningProcesses_v3)     \
    X(nvmlDeviceGetComputeRunningProcesses_v2) X(nvmlDeviceGetGraphicsRunningProcesses_v2)        \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v2) X(nvmlDeviceGetCurrentClocksThrottleReasons)    \
    X(nvmlDeviceGetProcessUtilization) X(nvmlDeviceGetSupportedEventTypes) X(nvmlEventSetCreate)  \
    X(nvmlDeviceRegisterEvents) X(nvmlEventSetWait_v2) X(nvmlEventSetFree)                       \
    X(nvmlDeviceGetMaxMigDeviceCount) X(nvmlDeviceGetMigDeviceHandleByIndex)                      \
    X(nvmlDeviceIsMigDeviceHandle) X(nvmlDeviceGetDeviceHandleFromMigDeviceHandle)                \
    X(nvmlDeviceGetGpuInstanceId) X(nvmlDeviceGetComputeInstanceId) X(nvmlDeviceGetSerial)      \
    X(nvmlDeviceGetVbiosVersion) X(nvmlDeviceGetTemperatureThreshold)                          \
    X(nvmlDeviceGetComputeRunningProcesses) X(nvmlDeviceGetGraphicsRunningProcesses)              \
    X(nvmlDeviceGetMPSComputeRunningProcesses) X(nvmlDeviceGetRunningProcessDetailList)           \
    X(nvmlDeviceGetConfComputeMemSizeInfo)

#define FK_ENUM(name) SYM_##name,
#define FK_NAME(name) #name,
enum { FK_SYMBOLS(FK_ENUM) FK_NSYM };
static const char *const fk_sym_names[FK_NSYM] = {FK_SYMBOLS(FK_NAME)};

static const struct {
    const char *name;
    nvmlReturn_t code;
    const char *text;
} fk_errors[] = {
    {"SUCCESS", NVML_SUCCESS, "Success"},
    {"UNINITIALIZED", NVML_ERROR_UNINITIALIZED, "Uninitialized"},
    {"INVALID_ARGUMENT", NVML_ERROR_INVALID_ARGUMENT, "Invalid Argument"},
    {"NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED, "Not Supported"},
    {"NO_PERMISSION", NVML_ERROR_NO_PERMISSION, "Insufficient Permissions"},
    {"ALREADY_INITIALIZED", NVML_ERROR_ALREADY_INITIALIZED, "Already Initialized"},
    {"NOT_FOUND", NVML_ERROR_NOT_FOUND, "Not Found"},
    {"INSUFFICIENT_SIZE", NVML_ERROR_INSUFFICIENT_SIZE, "Insufficient Size"},
    {"INSUFFICIENT_POWER", NVML_ERROR_INSUFFICIENT_POWER, "Insufficient External Power"},
    {"DRIVER_NOT_LOADED", NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"},
    {"TIMEOUT", NVML_ERROR_TIMEOUT, "Timeout"},
    {"IRQ_ISSUE", NVML_ERROR_IRQ_ISSUE, "Interrupt Request Issue"},
    {"LIBRARY_NOT_FOUND", NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"},
    {"FUNCTION_NOT_FOUND", NVML_ERROR_FUNCTION_NOT_FOUND, "Function Not Found"},
    {"CORRUPTED_INFOROM", NVML_ERROR_CORRUPTED_INFOROM, "Corrupted infoROM"},
    {"GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST, "GPU is lost"},
    {"RESET_REQUIRED", NVML_ERROR_RESET_REQUIRED, "GPU requires restart"},
    {"OPERATING_SYSTEM", NVML_ERROR_OPERATING_SYSTEM, "The operating system has blocked the request."},
    {"LIB_RM_VERSION_MISMATCH", NVML_ERROR_LIB_RM_VERSION_MISMATCH, "RM has detected an NVML/RM version mismatch."},
    {"IN_USE", NVML_ERROR_IN_USE, "In use by another client"},
    {"MEMORY", NVML_ERROR_MEMORY, "Insufficient Memory"},
    {"NO_DATA", NVML_ERROR_NO_DATA, "No data"},
    {"INSUFFICIENT_RESOURCES", NVML_ERROR_INSUFFICIENT_RESOURCES, "Insufficient resources"},
    {"ARGUMENT_VERSION_MISMATCH", NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "Argument version mismatch"},
    {"NOT_READY", NVML_ERROR_NOT_READY, "Not ready"},
    {"GPU_NOT_FOUND", NVML_ERROR_GPU_NOT_FOUND, "GPU not found"},
    {"UNKNOWN", NVML_ERROR_UNKNOWN, "Unknown Error"},
};
#define FK_NERRORS (sizeof(fk_errors) / sizeof(fk_errors[0]))
#define FK_ABORT (-1)
#define FK_SEGV (-2)
static volatile intptr_t fk_null_page = 0; /* written through by SEGV: the kernel's SIGSEGV */

typedef struct {
    double t, base, slope; /* value = base + slope * (now - t0 - t) from t on */
} fk_seg;

typedef struct {
    int nseg;
    fk_seg seg[FK_MAX_SEG];
} fk_value;

typedef struct {
    unsigned int pid;
    int na;
    fk_seg used;
    unsigned long long cc; /* usedGpuCcProtectedMemory (32-byte entries only) */
} fk_proc;

#define FK_PROC_KINDS 3
static const char *const fk_proc_lists[FK_PROC_KINDS] = {"processes", "graphics_processes",
                                                          "mps_processes"};

typedef struct {
    unsigned int pid, sm, mem, enc, dec;
} fk_putil;

typedef struct {
    unsigned long long code;
    double t;
} fk_xid;

/* Number fields, in the order of fk_field_names. */
enum {
    F_MEM_TOTAL, F_MEM_USED, F_MEM_RESERVED, F_UTIL_GPU, F_UTIL_MEM, F_UTIL_ENC, F_UTIL_DEC,
    F_TEMP, F_POWER, F_POWER_LIMIT, F_ENERGY, F_CLK_GRAPHICS, F_CLK_SM, F_CLK_MEM, F_CLK_VIDEO,
    F_PCIE_TX, F_PCIE_RX, F_ECC_CORR, F_ECC_UNCORR, F_MIG, F_MIG_PENDING, F_REASONS,
    F_SUPPORTED_EVENTS, F_PUTIL_PERIOD, F_PUTIL_OFFSET, F_TEMP_SHUTDOWN, F_TEMP_SLOWDOWN,
    F_NFIELDS
};
static const char *const fk_field_names[F_NFIELDS] = {
    "memory.total", "memory.used", "memory.reserved", "util.gpu", "util.memory",
    "util.encoder", "util.decoder", "temperature", "power.usage", "power.limit", "energy",
    "clock.graphics", "clock.sm", "clock.mem", "clock.video", "pcie.tx", "pcie.rx",
    "ecc.corrected", "ecc.uncorrected", "mig", "mig.pending", "clocks_event_reasons",
    "supported_events", "process_util.period_ms", "process_util.offset_ms",
    "temperature.shutdown", "temperature.slowdown"};
static const double fk_field_defaults[F_NFIELDS] = {
    85899345920.0, 1073741824.0, 536870912.0, 0, 0, 0, 0, 35, 70000, 700000, 1000000,
    1980, 1980, 2619, 1755, 0, 0, 0, 0, 0, 0, 0, 0xF, 1000, 0, 92, 89};

/* One MIG device (mig.N.I.*): a compute instance of GPU N, reachable while N's mig is 1. */
typedef struct {
    int present, has_name;
    char name[264], uuid[256]; /* room for the default: the parent's name + " MIG" */
    fk_value mem[3];          /* indexed by F_MEM_TOTAL, F_MEM_USED, F_MEM_RESERVED */
    int nproc[FK_PROC_KINDS];
    fk_proc *procs[FK_PROC_KINDS];
    unsigned int gi, ci; /* GPU / compute instance ids */
} fk_mig;

typedef struct {
    char name[256], uuid[256], bus_id[32]; /* longer than NVML's 96: overlong strings */
    char serial[256], vbios[256];
    fk_value f[F_NFIELDS];
    int nproc[FK_PROC_KINDS], nputil, nxid;
    fk_proc *procs[FK_PROC_KINDS]; /* compute, graphics, MPS compute */
    fk_putil *putil;
    fk_xid xid[FK_MAX_XID];
    fk_mig mig[FK_MAX_MIG];
} fk_dev;

typedef struct {
    int fail; /* 1: fail rule, 0: delay rule */
    int sym;  /* -1: every symbol */
    int dev;  /* -1: any GPU (and calls without one) */
    int code; /* NVML code or FK_ABORT */
    long delay_ms;
    unsigned long long after, until, every;
    double from, to;
    int has_until, has_from, has_to;
} fk_rule;

typedef struct {
    int ndev;
    double t0;
    char driver[80], nvml_version[80];
    int cuda_version;
    fk_dev dev[FK_MAX_GPUS];
    int nrules;
    fk_rule rules[FK_MAX_RULES];
} fk_scenario;

struct nvmlDevice_st {
    int index; /* GPU index (a MIG device's parent) */
    int mig;   /* MIG device index, -1 for a GPU */
};
struct nvmlEventSet_st {
    int in_use;
    unsigned long long types[FK_MAX_GPUS];
};

static pthread_mutex_t fk_mu = PTHREAD_MUTEX_INITIALIZER;
static fk_scenario *S;                 /* current scenario, replaced whole on reload */
static int fk_init_refs;               /* nvmlInit* minus nvmlShutdown */
static char fk_path[4096];             /* scenario path last loaded ("" = none) */
static struct stat fk_stat;            /* identity of the loaded file */
static long long fk_last_check_ns;     /* monotonic coarse, throttles stat() */
static char fk_error[512];             /* last scenario error */
static struct nvmlDevice_st fk_handles[FK_MAX_GPUS];
/* MIG device handles: fixed addresses, so the same (N, I) keeps its handle across reloads. */
static struct nvmlDevice_st fk_mig_handles[FK_MAX_GPUS][FK_MAX_MIG];
static struct nvmlEventSet_st fk_sets[FK_MAX_SETS];
static int fk_xid_delivered[FK_MAX_GPUS];
static unsigned long long fk_load_count[FK_NSYM][FK_MAX_GPUS + 1]; /* since reload, for rules */
static unsigned long long fk_total_count[FK_NSYM][FK_MAX_GPUS + 1]; /* for tests */
static int fk_atexit_registered;

static double fk_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static long long fk_mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void fk_sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static double fk_eval(const fk_value *v, double rel) {
    int i = 0;
    while (i + 1 < v->nseg && v->seg[i + 1].t <= rel) i++;
    const fk_seg *s = &v->seg[i];
    return s->base + s->slope * (rel - s->t);
}

/* Non-negative value of a VALUE now, rounded, clamped to the type's range. */
static unsigned long long fk_u64v(const fk_value *f) {
    double v = fk_eval(f, fk_now() - S->t0);
    if (!(v > 0)) return 0;
    if (v >= 18446744073709549568.0) return FK_NOT_AVAILABLE - 1;
    return (unsigned long long)(v + 0.5);
}

static unsigned long long fk_u64(const fk_dev *d, int field) { return fk_u64v(&d->f[field]); }

static unsigned int fk_u32(const fk_dev *d, int field) {
    unsigned long long v = fk_u64(d, field);
    return v > 0xFFFFFFFFULL ? 0xFFFFFFFFU : (unsigned int)v;
}

/* GPU d is in MIG mode now (its mig field evaluates to 1: NVML_DEVICE_MIG_ENABLE). */
static int fk_mig_on(const fk_dev *d) { return fk_u64(d, F_MIG) == 1; }

/* ---------------------------------- scenario parsing ---------------------------------- */

static char *fk_trim(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    char *e = s + strlen(s);
    while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r' || e[-1] == '\n')) *--e = 0;
    return s;
}

/* Parses "BASE[(+|-)SLOPE/s]"; returns the end or NULL. */
static const char *fk_parse_seg(const char *p, fk_seg *seg) {
    char *end;
    seg->base = strtod(p, &end);
    if (end == p) return NULL;
    seg->slope = 0;
    p = end;
    while (*p == ' ') p++;
    if (*p == '+' || *p == '-') {
        const char *q = p + (*p == '+');
        seg->slope = strtod(q, &end);
        if (end == q) return NULL;
        p = end;
        while (*p == ' ') p++;
        if (p[0] != '/' || p[1] != 's') return NULL;
        p += 2;
    }
    return p;
}

static int fk_parse_value(char *text, fk_value *v) {
    memset(v, 0, sizeof(*v));
    if (strncmp(text, "steps", 5) == 0 && (text[5] == ' ' || text[5] == '\t')) {
        char *save = NULL;
        for (char *tok = strtok_r(text + 5, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save)) {
            if (v->nseg == FK_MAX_SEG) return -1;
            char *colon = strchr(tok, ':');
            if (!colon) return -1;
            *colon = 0;
            char *end;
            double t = strtod(tok, &end);
            if (end == tok || *end) return -1;
            fk_seg *s = &v->seg[v->nseg];
            const char *rest = fk_parse_seg(colon + 1, s);
            if (!rest || *rest) return -1;
            if (v->nseg && t <= v->seg[v->nseg - 1].t) return -1;
            s->t = t;
            v->nseg++;
        }
        return v->nseg ? 0 : -1;
    }
    const char *rest = fk_parse_seg(text, &v->seg[0]);
    if (!rest || *rest) return -1;
    v->nseg = 1;
    return 0;
}

static int fk_code_by_name(const char *s, int *code) {
    if (strcmp(s, "ABORT") == 0) {
        *code = FK_ABORT;
        return 0;
    }
    if (strcmp(s, "SEGV") == 0) {
        *code = FK_SEGV;
        return 0;
    }
    const char *n = strncmp(s, "NVML_ERROR_", 11) == 0 ? s + 11 : s;
    for (size_t i = 0; i < FK_NERRORS; i++)
        if (strcmp(n, fk_errors[i].name) == 0) {
            *code = (int)fk_errors[i].code;
            return 0;
        }
    char *end;
    long v = strtol(s, &end, 0);
    if (end == s || *end) return -1;
    *code = (int)v;
    return 0;
}

static int fk_sym_by_name(const char *s) {
    if (strcmp(s, "*") == 0) return -1;
    for (int i = 0; i < FK_NSYM; i++)
        if (strcmp(s, fk_sym_names[i]) == 0) return i;
    return -2;
}

static void fk_default_dev(fk_dev *d, int i) {
    memset(d, 0, sizeof(*d));
    snprintf(d->name, sizeof d->name, "NVIDIA H100 80GB HBM3");
    snprintf(d->uuid, sizeof d->uuid, "GPU-fa4e0000-0000-4000-8000-%012x", i);
    snprintf(d->bus_id, sizeof d->bus_id, "00000000:%02X:00.0", (0x18 + i * 0x10) & 0xFF);
    snprintf(d->serial, sizeof d->serial, "165092301%04d", i);
    snprintf(d->vbios, sizeof d->vbios, "96.00.99.00.01");
    for (int f = 0; f < F_NFIELDS; f++) {
        d->f[f].nseg = 1;
        d->f[f].seg[0].base = fk_field_defaults[f];
    }
    /* Energy grows with the default power (70 W = 70000 mJ/s), as on a real GPU. */
    d->f[F_ENERGY].seg[0].slope = fk_field_defaults[F_POWER];
}

static void fk_free_scenario(fk_scenario *s) {
    if (!s) return;
    for (int i = 0; i < FK_MAX_GPUS; i++) {
        for (int k = 0; k < FK_PROC_KINDS; k++) {
            free(s->dev[i].procs[k]);
            for (int m = 0; m < FK_MAX_MIG; m++) free(s->dev[i].mig[m].procs[k]);
        }
        free(s->dev[i].putil);
    }
    free(s);
}

static int fk_count_tokens(const char *s) {
    int n = 0, in = 0;
    for (; *s; s++) {
        int ws = *s == ' ' || *s == '\t';
        if (!ws && !in) n++;
        in = !ws;
    }
    return n;
}

/* Index of a process list field name in fk_proc_lists, or -1. */
static int fk_proc_kind(const char *field) {
    for (int k = 0; k < FK_PROC_KINDS; k++)
        if (strcmp(field, fk_proc_lists[k]) == 0) return k;
    return -1;
}

/* Parses "PID:USED ..." into a new array replacing *procs (GPU and MIG lists alike). */
static int fk_parse_procs(fk_proc **procs, int *nproc, char *val) {
    int n = fk_count_tokens(val);
    char *save = NULL;
    free(*procs);
    *procs = calloc((size_t)(n ? n : 1), sizeof(fk_proc));
    *nproc = 0;
    if (!*procs) return -1;
    for (char *tok = strtok_r(val, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save)) {
        fk_proc *p = &(*procs)[*nproc];
        char *colon = strchr(tok, ':'), *end;
        if (!colon) return -1;
        *colon = 0;
        p->pid = (unsigned int)strtoul(tok, &end, 10);
        if (end == tok || *end) return -1;
        char *cc = strchr(colon + 1, ':'); /* PID:USED:CC */
        if (cc) {
            *cc++ = 0;
            if (strcmp(cc, "na") == 0) {
                p->cc = FK_NOT_AVAILABLE;
            } else {
                p->cc = strtoull(cc, &end, 0);
                if (end == cc || *end) return -1;
            }
        }
        if (strcmp(colon + 1, "na") == 0) {
            p->na = 1;
        } else {
            const char *rest = fk_parse_seg(colon + 1, &p->used);
            if (!rest || *rest) return -1;
        }
        (*nproc)++;
    }
    return 0;
}

static int fk_parse_list(fk_dev *d, const char *field, char *val) {
    int n = fk_count_tokens(val);
    char *save = NULL;
    int kind = fk_proc_kind(field);
    if (kind >= 0) return fk_parse_procs(&d->procs[kind], &d->nproc[kind], val);
    if (strcmp(field, "process_util") == 0) {
        free(d->putil);
        d->putil = calloc((size_t)(n ? n : 1), sizeof(fk_putil));
        d->nputil = 0;
        for (char *tok = strtok_r(val, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save)) {
            fk_putil *u = &d->putil[d->nputil];
            int got = sscanf(tok, "%u:%u:%u:%u:%u", &u->pid, &u->sm, &u->mem, &u->enc, &u->dec);
            if (got != 3 && got != 5) return -1;
            d->nputil++;
        }
        return 0;
    }
    if (strcmp(field, "xid") == 0) {
        d->nxid = 0;
        for (char *tok = strtok_r(val, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save)) {
            if (d->nxid == FK_MAX_XID) return -1;
            fk_xid *x = &d->xid[d->nxid];
            char *end;
            x->code = strtoull(tok, &end, 0);
            x->t = 0;
            if (end == tok) return -1;
            if (*end == '@') {
                char *q = end + 1;
                x->t = strtod(q, &end);
                if (end == q) return -1;
            }
            if (*end) return -1;
            d->nxid++;
        }
        return 0;
    }
    return 1; /* not a list field */
}

static int fk_hex(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Copies a string field, decoding \xNN (any byte but NUL: names that are not UTF-8) and \\;
 * -1 for any other escape. */
static int fk_set_str(char *dst, size_t size, const char *val) {
    size_t n = 0;
    for (const char *p = val; *p; p++) {
        int c = (unsigned char)*p;
        if (c == '\\') {
            if (p[1] == '\\') {
                p++;
            } else if (p[1] == 'x' && fk_hex(p[2]) >= 0 && fk_hex(p[3]) >= 0) {
                c = fk_hex(p[2]) * 16 + fk_hex(p[3]);
                if (c == 0) return -1;
                p += 3;
            } else {
                return -1;
            }
        }
        if (n + 1 < size) dst[n++] = (char)c;
    }
    dst[n] = 0;
    return 0;
}

static int fk_set_dev_field(fk_dev *d, const char *field, const char *val) {
    if (strcmp(field, "name") == 0) return fk_set_str(d->name, sizeof d->name, val);
    if (strcmp(field, "uuid") == 0) return fk_set_str(d->uuid, sizeof d->uuid, val);
    if (strcmp(field, "pci_bus_id") == 0) return fk_set_str(d->bus_id, sizeof d->bus_id, val);
    if (strcmp(field, "serial") == 0) return fk_set_str(d->serial, sizeof d->serial, val);
    if (strcmp(field, "vbios") == 0) return fk_set_str(d->vbios, sizeof d->vbios, val);
    char *buf = strdup(val); /* the parsers cut their copy into tokens */
    int r = buf ? fk_parse_list(d, field, buf) : -1;
    for (int f = 0; r == 1 && f < F_NFIELDS; f++)
        if (strcmp(field, fk_field_names[f]) == 0) {
            strcpy(buf, val);
            r = fk_parse_value(buf, &d->f[f]);
        }
    free(buf);
    return r == 1 ? -2 : r;
}

/* Parses a non-negative decimal index (digits only) below `limit`, ending at `stop`. */
static int fk_parse_index(const char *p, char stop, int limit, const char **next) {
    if (*p < '0' || *p > '9') return -1;
    char *end;
    long v = strtol(p, &end, 10);
    if (*end != stop || v >= limit) return -1;
    *next = end;
    return (int)v;
}

/* A "mig.N.I.<field> = value" line (`key` is what follows "mig."); creates instance I of GPU N
 * with its defaults on its first line. Returns 0, or -1 for a malformed line. */
static int fk_parse_mig_line(fk_scenario *s, const char *key, const char *val) {
    const char *p;
    int n = fk_parse_index(key, '.', FK_MAX_GPUS, &p);
    if (n < 0) return -1;
    int i = fk_parse_index(p + 1, '.', FK_MAX_MIG, &p);
    if (i < 0) return -1;
    const char *field = p + 1;
    fk_mig *m = &s->dev[n].mig[i];
    if (!m->present) {
        m->present = 1;
        snprintf(m->uuid, sizeof m->uuid, "MIG-%08x-%04x-4000-8000-000000000000", (unsigned)n,
                 (unsigned)i);
        for (int f = 0; f < 3; f++) m->mem[f].nseg = 1;
        m->mem[F_MEM_TOTAL].seg[0].base = 10737418240.0; /* 10 GiB; used and reserved 0 */
        m->gi = (unsigned int)i + 1;
        m->ci = 0;
    }
    if (strcmp(field, "name") == 0) {
        m->has_name = 1;
        return fk_set_str(m->name, sizeof m->name, val);
    }
    if (strcmp(field, "uuid") == 0) return fk_set_str(m->uuid, sizeof m->uuid, val);
    if (strcmp(field, "gi") == 0 || strcmp(field, "ci") == 0) {
        char *end;
        if (*val < '0' || *val > '9') return -1;
        unsigned long v = strtoul(val, &end, 0);
        if (*end || v > 0xFFFFFFFFUL) return -1;
        *(field[0] == 'g' ? &m->gi : &m->ci) = (unsigned int)v;
        return 0;
    }
    char *buf = strdup(val); /* the parsers cut their copy into tokens */
    if (!buf) return -1;
    int r = -1, kind = fk_proc_kind(field);
    if (kind >= 0) r = fk_parse_procs(&m->procs[kind], &m->nproc[kind], buf);
    for (int f = F_MEM_TOTAL; kind < 0 && f <= F_MEM_RESERVED; f++)
        if (strcmp(field, fk_field_names[f]) == 0) r = fk_parse_value(buf, &m->mem[f]);
    free(buf);
    return r;
}

static int fk_parse_rule(fk_scenario *s, int fail, char *target, char *val) {
    if (s->nrules == FK_MAX_RULES) return -1;
    fk_rule *r = &s->rules[s->nrules];
    memset(r, 0, sizeof(*r));
    r->fail = fail;
    r->dev = -1;
    char *dot = strchr(target, '.');
    if (dot) {
        *dot = 0;
        if (strcmp(dot + 1, "*") != 0) {
            char *end;
            r->dev = (int)strtol(dot + 1, &end, 10);
            if (end == dot + 1 || *end || r->dev < 0 || r->dev >= FK_MAX_GPUS) return -1;
        }
    }
    r->sym = fk_sym_by_name(target);
    if (r->sym == -2) return -1;
    char *save = NULL;
    char *tok = strtok_r(val, " \t", &save);
    if (!tok) return -1;
    if (fail) {
        if (fk_code_by_name(tok, &r->code) != 0) return -1;
    } else {
        char *end;
        r->delay_ms = strtol(tok, &end, 10);
        if (end == tok || *end || r->delay_ms < 0) return -1;
    }
    while ((tok = strtok_r(NULL, " \t", &save))) {
        char *eq = strchr(tok, '='), *end;
        if (!eq) return -1;
        *eq = 0;
        const char *v = eq + 1;
        if (strcmp(tok, "after") == 0) {
            r->after = strtoull(v, &end, 10);
        } else if (strcmp(tok, "until") == 0) {
            r->until = strtoull(v, &end, 10);
            r->has_until = 1;
        } else if (strcmp(tok, "every") == 0) {
            r->every = strtoull(v, &end, 10);
        } else if (strcmp(tok, "from") == 0) {
            r->from = strtod(v, &end);
            r->has_from = 1;
        } else if (strcmp(tok, "to") == 0) {
            r->to = strtod(v, &end);
            r->has_to = 1;
        } else {
            return -1;
        }
        if (end == v || *end) return -1;
    }
    s->nrules++;
    return 0;
}

/* Parses the file into a new scenario; on error sets fk_error and returns NULL. */
static fk_scenario *fk_parse_file(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(fk_error, sizeof fk_error, "fakenvml: cannot read scenario %s: %s", path,
                 strerror(errno));
        return NULL;
    }
    fk_scenario *s = calloc(1, sizeof(fk_scenario));
    s->ndev = 1;
    s->t0 = fk_now();
    snprintf(s->driver, sizeof s->driver, "550.54.15");
    snprintf(s->nvml_version, sizeof s->nvml_version, "12.550.54.15");
    s->cuda_version = 12040;
    for (int i = 0; i < FK_MAX_GPUS; i++) fk_default_dev(&s->dev[i], i);
    char *line = NULL;
    size_t cap = 0;
    int lineno = 0, bad = 0;
    while (!bad && getline(&line, &cap, f) >= 0) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *l = fk_trim(line);
        if (!*l) continue;
        char *eq = strchr(l, '=');
        if (!eq) {
            bad = 1;
            break;
        }
        *eq = 0;
        char *key = fk_trim(l), *val = fk_trim(eq + 1), *end;
        if (strcmp(key, "devices") == 0) {
            s->ndev = (int)strtol(val, &end, 10);
            bad = end == val || *end || s->ndev < 0 || s->ndev > FK_MAX_GPUS;
        } else if (strcmp(key, "t0") == 0) {
            s->t0 = strtod(val, &end);
            bad = end == val || *end;
        } else if (strcmp(key, "driver_version") == 0) {
            snprintf(s->driver, sizeof s->driver, "%s", val);
        } else if (strcmp(key, "nvml_version") == 0) {
            snprintf(s->nvml_version, sizeof s->nvml_version, "%s", val);
        } else if (strcmp(key, "cuda_driver_version") == 0) {
            s->cuda_version = (int)strtol(val, &end, 10);
            bad = end == val || *end;
        } else if (strncmp(key, "gpu.", 4) == 0) {
            char *dot = strchr(key + 4, '.');
            if (!dot) {
                bad = 1;
                break;
            }
            *dot = 0;
            int lo = 0, hi = FK_MAX_GPUS - 1;
            if (strcmp(key + 4, "*") != 0) {
                lo = hi = (int)strtol(key + 4, &end, 10);
                if (end == key + 4 || *end || lo < 0 || lo >= FK_MAX_GPUS) {
                    bad = 1;
                    break;
                }
            }
            for (int i = lo; i <= hi && !bad; i++) bad = fk_set_dev_field(&s->dev[i], dot + 1, val) != 0;
        } else if (strncmp(key, "mig.", 4) == 0) {
            bad = fk_parse_mig_line(s, key + 4, val) != 0;
        } else if (strncmp(key, "fail.", 5) == 0) {
            bad = fk_parse_rule(s, 1, key + 5, val) != 0;
        } else if (strncmp(key, "delay.", 6) == 0) {
            bad = fk_parse_rule(s, 0, key + 6, val) != 0;
        } else {
            bad = 1;
        }
    }
    free(line);
    fclose(f);
    if (bad) {
        snprintf(fk_error, sizeof fk_error, "fakenvml: %s:%d: cannot parse this line", path,
                 lineno);
        fk_free_scenario(s);
        return NULL;
    }
    /* Default MIG names follow the parent's final name, whichever line came first. */
    for (int i = 0; i < FK_MAX_GPUS; i++)
        for (int m = 0; m < FK_MAX_MIG; m++) {
            fk_mig *g = &s->dev[i].mig[m];
            if (g->present && !g->has_name)
                snprintf(g->name, sizeof g->name, "%s MIG", s->dev[i].name);
        }
    return s;
}

static fk_scenario *fk_default_scenario(void) {
    fk_scenario *s = calloc(1, sizeof(fk_scenario));
    s->ndev = 1;
    s->t0 = fk_now();
    snprintf(s->driver, sizeof s->driver, "550.54.15");
    snprintf(s->nvml_version, sizeof s->nvml_version, "12.550.54.15");
    s->cuda_version = 12040;
    for (int i = 0; i < FK_MAX_GPUS; i++) fk_default_dev(&s->dev[i], i);
    return s;
}

/* Re-reads the scenario when the file changed. Caller holds fk_mu. Returns -1 on error. */
static int fk_maybe_reload(int force) {
    long long mono = fk_mono_ns();
    if (!force && S && mono - fk_last_check_ns < 10000000LL) return 0;
    fk_last_check_ns = mono;
    const char *path = getenv("FAKE_NVML_SCENARIO");
    if (!path || !*path) {
        if (S && fk_path[0] == 0) return 0;
        fk_free_scenario(S);
        S = fk_default_scenario();
        fk_path[0] = 0;
        memset(fk_load_count, 0, sizeof fk_load_count);
        memset(fk_xid_delivered, 0, sizeof fk_xid_delivered);
        return 0;
    }
    int same_path = S && strcmp(path, fk_path) == 0;
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(fk_error, sizeof fk_error, "fakenvml: cannot read scenario %s: %s", path,
                 strerror(errno));
        return same_path ? 0 : -1;
    }
    if (same_path && st.st_ino == fk_stat.st_ino && st.st_size == fk_stat.st_size &&
        st.st_mtim.tv_sec == fk_stat.st_mtim.tv_sec && st.st_mtim.tv_nsec == fk_stat.st_mtim.tv_nsec)
        return 0;
    fk_scenario *s = fk_parse_file(path);
    if (!s) {
        fprintf(stderr, "%s\n", fk_error);
        if (!same_path) return -1;
        fk_stat = st; /* keep the previous scenario; do not re-parse this version again */
        return 0;
    }
    fk_free_scenario(S);
    S = s;
    fk_stat = st;
    if (!same_path) memset(fk_xid_delivered, 0, sizeof fk_xid_delivered);
    snprintf(fk_path, sizeof fk_path, "%s", path);
    memset(fk_load_count, 0, sizeof fk_load_count);
    fk_error[0] = 0;
    return 0;
}

/* ------------------------------------ call entry ------------------------------------ */

/* Counts the call, applies rules; returns the code the call must return (after its delay). */
static nvmlReturn_t fk_enter(int sym, int dev, int need_init) {
    pthread_mutex_lock(&fk_mu);
    fk_maybe_reload(0);
    if (need_init && (fk_init_refs <= 0 || !S)) {
        pthread_mutex_unlock(&fk_mu);
        return NVML_ERROR_UNINITIALIZED;
    }
    int slot = dev < 0 ? FK_MAX_GPUS : dev;
    unsigned long long k = ++fk_load_count[sym][slot];
    fk_total_count[sym][slot]++;
    int code = NVML_SUCCESS, have_fail = 0, have_delay = 0;
    long delay = 0;
    double rel = S ? fk_now() - S->t0 : 0;
    for (int i = 0; S && i < S->nrules && !(have_fail && have_delay); i++) {
        const fk_rule *r = &S->rules[i];
        if ((r->fail && have_fail) || (!r->fail && have_delay)) continue;
        if (r->sym >= 0 && r->sym != sym) continue;
        if (r->dev >= 0 && r->dev != dev) continue;
        if (k <= r->after || (r->has_until && k > r->until)) continue;
        if (r->every && (k - r->after) % r->every != 0) continue;
        if ((r->has_from && rel < r->from) || (r->has_to && rel >= r->to)) continue;
        if (r->fail) {
            code = r->code;
            have_fail = 1;
        } else {
            delay = r->delay_ms;
            have_delay = 1;
        }
    }
    pthread_mutex_unlock(&fk_mu);
    if (delay > 0) fk_sleep_ms(delay);
    if (code == FK_ABORT) abort();
    if (code == FK_SEGV) *(volatile int *)fk_null_page = 1; /* a real fault, as a driver bug */
    return (nvmlReturn_t)code;
}

/* GPU index of a handle (a MIG device's parent), or -1 when it is not one of ours; *mig is
 * the MIG device index, or -1 for a GPU handle. */
static int fk_dev_index(nvmlDevice_t device, int *mig) {
    *mig = -1;
    if (device >= fk_handles && device < fk_handles + FK_MAX_GPUS)
        return (int)(device - fk_handles);
    const struct nvmlDevice_st *first = &fk_mig_handles[0][0];
    if (device < first || device >= first + FK_MAX_GPUS * FK_MAX_MIG) return -1;
    int k = (int)(device - first);
    *mig = k % FK_MAX_MIG;
    return k / FK_MAX_MIG;
}

/* The MIG device behind a handle, while it exists: declared, its parent present and in MIG
 * mode. Caller holds fk_mu. */
static const fk_mig *fk_live_mig(int idx, int mig) {
    if (!S || idx >= S->ndev || mig < 0) return NULL;
    const fk_dev *d = &S->dev[idx];
    return d->mig[mig].present && fk_mig_on(d) ? &d->mig[mig] : NULL;
}

/* Device call prologue for functions that take GPU and MIG handles (`handle`): validates
 * it, counts the call and applies rules under the GPU index (a MIG device's parent), then
 * locks fk_mu and binds `d` to the GPU (the parent) and `m` to the MIG device (NULL for a GPU
 * handle). A MIG handle whose device is gone (a reload removed it, or MIG mode is off) gives
 * NOT_FOUND. Every path after it must unlock. */
#define DEV_ENTER_OF(name, handle)                                               \
    int mig_;                                                                    \
    int idx_ = fk_dev_index(handle, &mig_);                                      \
    nvmlReturn_t rc_ = fk_enter(SYM_##name, idx_ < 0 ? -1 : idx_, 1);            \
    if (rc_ != NVML_SUCCESS) return rc_;                                         \
    if (idx_ < 0) return NVML_ERROR_INVALID_ARGUMENT;                            \
    pthread_mutex_lock(&fk_mu);                                                  \
    const fk_mig *m = fk_live_mig(idx_, mig_);                                   \
    if (!S || idx_ >= S->ndev || (mig_ >= 0 && !m)) {                            \
        pthread_mutex_unlock(&fk_mu);                                            \
        return mig_ >= 0 ? NVML_ERROR_NOT_FOUND : NVML_ERROR_INVALID_ARGUMENT;   \
    }                                                                            \
    const fk_dev *d = &S->dev[idx_];

#define DEV_ENTER_ANY(name) DEV_ENTER_OF(name, device)

/* Prologue for the GPU-only functions: as DEV_ENTER_ANY, and a (live) MIG handle gives
 * NOT_SUPPORTED, as NVML does for queries that have no per-instance value. */
#define DEV_ENTER(name)                                                          \
    DEV_ENTER_ANY(name)                                                          \
    if (m) {                                                                     \
        pthread_mutex_unlock(&fk_mu);                                            \
        return NVML_ERROR_NOT_SUPPORTED;                                         \
    }

#define DEV_RETURN(rc)              \
    do {                            \
        pthread_mutex_unlock(&fk_mu); \
        return (rc);                \
    } while (0)

/* --------------------------------- NVML: system --------------------------------- */

static void fk_write_stats(void) {
    const char *path = getenv("FAKE_NVML_STATS");
    if (!path || !*path) return;
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    for (int s = 0; s < FK_NSYM; s++)
        for (int g = 0; g <= FK_MAX_GPUS; g++)
            if (fk_total_count[s][g])
                fprintf(f, "%s %d %llu\n", fk_sym_names[s], g == FK_MAX_GPUS ? -1 : g,
                        fk_total_count[s][g]);
    fclose(f);
    rename(tmp, path);
}

static nvmlReturn_t fk_init(int sym) {
    pthread_mutex_lock(&fk_mu);
    int bad = fk_maybe_reload(1) != 0 || !S;
    if (!fk_atexit_registered) {
        fk_atexit_registered = 1;
        atexit(fk_write_stats);
    }
    pthread_mutex_unlock(&fk_mu);
    if (bad) {
        fprintf(stderr, "%s\n", fk_error);
        return NVML_ERROR_UNKNOWN;
    }
    nvmlReturn_t rc = fk_enter(sym, -1, 0);
    if (rc != NVML_SUCCESS) return rc;
    pthread_mutex_lock(&fk_mu);
    fk_init_refs++;
    for (int i = 0; i < FK_MAX_GPUS; i++) {
        fk_handles[i] = (struct nvmlDevice_st){i, -1};
        for (int m = 0; m < FK_MAX_MIG; m++) fk_mig_handles[i][m] = (struct nvmlDevice_st){i, m};
    }
    pthread_mutex_unlock(&fk_mu);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return fk_init(SYM_nvmlInit_v2); }

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return fk_init(SYM_nvmlInitWithFlags);
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t rc = fk_enter(SYM_nvmlShutdown, -1, 1);
    if (rc != NVML_SUCCESS) return rc;
    pthread_mutex_lock(&fk_mu);
    int last = --fk_init_refs == 0;
    pthread_mutex_unlock(&fk_mu);
    if (last) fk_write_stats();
    return NVML_SUCCESS;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    pthread_mutex_lock(&fk_mu);
    fk_total_count[SYM_nvmlErrorString][FK_MAX_GPUS]++;
    pthread_mutex_unlock(&fk_mu);
    for (size_t i = 0; i < FK_NERRORS; i++)
        if (fk_errors[i].code == result) return fk_errors[i].text;
    return "Unknown Error";
}

static nvmlReturn_t fk_copy_str(char *dst, unsigned int length, const char *src) {
    size_t n = strlen(src);
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < n + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = fk_enter(SYM_nvmlSystemGetDriverVersion, -1, 1);
    if (rc != NVML_SUCCESS) return rc;
    pthread_mutex_lock(&fk_mu);
    rc = fk_copy_str(version, length, S->driver);
    pthread_mutex_unlock(&fk_mu);
    return rc;
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = fk_enter(SYM_nvmlSystemGetNVMLVersion, -1, 0);
    if (rc != NVML_SUCCESS) return rc;
    pthread_mutex_lock(&fk_mu);
    rc = S ? fk_copy_str(version, length, S->nvml_version) : NVML_ERROR_UNINITIALIZED;
    pthread_mutex_unlock(&fk_mu);
    return rc;
}

static nvmlReturn_t fk_cuda_version(int sym, int *v) {
    nvmlReturn_t rc = fk_enter(sym, -1, 0);
    if (rc != NVML_SUCCESS) return rc;
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&fk_mu);
    *v = S ? S->cuda_version : 0;
    pthread_mutex_unlock(&fk_mu);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    return fk_cuda_version(SYM_nvmlSystemGetCudaDriverVersion, cudaDriverVersion);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return fk_cuda_version(SYM_nvmlSystemGetCudaDriverVersion_v2, cudaDriverVersion);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    nvmlReturn_t rc = fk_enter(SYM_nvmlDeviceGetCount_v2, -1, 1);
    if (rc != NVML_SUCCESS) return rc;
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&fk_mu);
    *deviceCount = (unsigned int)S->ndev;
    pthread_mutex_unlock(&fk_mu);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    int dev = index < FK_MAX_GPUS ? (int)index : -1;
    nvmlReturn_t rc = fk_enter(SYM_nvmlDeviceGetHandleByIndex_v2, dev, 1);
    if (rc != NVML_SUCCESS) return rc;
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&fk_mu);
    rc = dev >= 0 && dev < S->ndev ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_unlock(&fk_mu);
    if (rc == NVML_SUCCESS) *device = &fk_handles[dev];
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    nvmlReturn_t rc = fk_enter(SYM_nvmlDeviceGetHandleByUUID, -1, 1);
    if (rc != NVML_SUCCESS) return rc;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    rc = NVML_ERROR_NOT_FOUND;
    pthread_mutex_lock(&fk_mu);
    for (int i = 0; i < S->ndev; i++)
        if (strcmp(S->dev[i].uuid, uuid) == 0) {
            *device = &fk_handles[i];
            rc = NVML_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&fk_mu);
    return rc;
}

/* --------------------------------- NVML: devices --------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    DEV_ENTER(nvmlDeviceGetIndex)
    (void)d;
    if (!index) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)idx_;
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEV_ENTER_ANY(nvmlDeviceGetName)
    DEV_RETURN(fk_copy_str(name, length, m ? m->name : d->name));
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEV_ENTER_ANY(nvmlDeviceGetUUID)
    DEV_RETURN(fk_copy_str(uuid, length, m ? m->uuid : d->uuid));
}

EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length) {
    DEV_ENTER(nvmlDeviceGetSerial)
    DEV_RETURN(fk_copy_str(serial, length, d->serial));
}

EXPORT nvmlReturn_t nvmlDeviceGetVbiosVersion(nvmlDevice_t device, char *version,
                                              unsigned int length) {
    DEV_ENTER(nvmlDeviceGetVbiosVersion)
    DEV_RETURN(fk_copy_str(version, length, d->vbios));
}

/* The shutdown and slowdown thresholds (memory max and GPU max: NOT_SUPPORTED, as on boards
 * without them). */
EXPORT nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device,
                                                      nvmlTemperatureThresholds_t thresholdType,
                                                      unsigned int *temp) {
    DEV_ENTER(nvmlDeviceGetTemperatureThreshold)
    if (!temp) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (thresholdType != NVML_TEMPERATURE_THRESHOLD_SHUTDOWN &&
        thresholdType != NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        DEV_RETURN(NVML_ERROR_NOT_SUPPORTED);
    *temp = fk_u32(d, thresholdType == NVML_TEMPERATURE_THRESHOLD_SHUTDOWN ? F_TEMP_SHUTDOWN
                                                                             : F_TEMP_SLOWDOWN);
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEV_ENTER(nvmlDeviceGetPciInfo_v3)
    if (!pci) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof(*pci));
    snprintf(pci->busId, sizeof pci->busId, "%s", d->bus_id);
    /* The legacy field holds the short form "0000:BB:DD.F". */
    const char *legacy = strlen(d->bus_id) > 12 ? d->bus_id + 4 : d->bus_id;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%s", legacy);
    unsigned int dom = 0, bus = 0, dv = 0, fn = 0;
    if (sscanf(d->bus_id, "%x:%x:%x.%x", &dom, &bus, &dv, &fn) == 4) {
        pci->domain = dom;
        pci->bus = bus;
        pci->device = dv;
    }
    pci->pciDeviceId = 0x233010DE;
    pci->pciSubSystemId = 0x16C110DE;
    DEV_RETURN(NVML_SUCCESS);
}

/* Memory of a GPU or MIG device now: total, used (including reserved) and reserved, with
 * reserved <= used. "used" may exceed "total", as some drivers report; "free" is then 0. */
static void fk_memory(const fk_dev *d, const fk_mig *m, unsigned long long *total,
                      unsigned long long *used, unsigned long long *reserved) {
    const fk_value *f = m ? m->mem : d->f; /* both indexed by F_MEM_TOTAL.. F_MEM_RESERVED */
    *total = fk_u64v(&f[F_MEM_TOTAL]);
    *used = fk_u64v(&f[F_MEM_USED]);
    *reserved = fk_u64v(&f[F_MEM_RESERVED]);
    if (*reserved > *used) *reserved = *used;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEV_ENTER_ANY(nvmlDeviceGetMemoryInfo)
    if (!memory) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long total, used, reserved;
    fk_memory(d, m, &total, &used, &reserved);
    memory->total = total;
    memory->used = used;
    memory->free = used > total ? 0 : total - used;
    DEV_RETURN(NVML_SUCCESS);
}

#if FK_HAS_MEMORY_V2 /* before 510.39.01: nvmlDeviceGetMemoryInfo only */
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    DEV_ENTER_ANY(nvmlDeviceGetMemoryInfo_v2)
    if (!memory) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != nvmlMemory_v2) DEV_RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned long long total, used, reserved;
    fk_memory(d, m, &total, &used, &reserved);
    memory->total = total;
    memory->reserved = reserved;
    memory->used = used - reserved; /* v2 "used" excludes the reserved part */
    memory->free = used > total ? 0 : total - used;
    DEV_RETURN(NVML_SUCCESS);
}
#endif

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                  nvmlUtilization_t *utilization) {
    DEV_ENTER(nvmlDeviceGetUtilizationRates)
    if (fk_mig_on(d)) DEV_RETURN(NVML_ERROR_NOT_SUPPORTED); /* no whole-GPU value in MIG mode */
    if (!utilization) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    utilization->gpu = fk_u32(d, F_UTIL_GPU);
    utilization->memory = fk_u32(d, F_UTIL_MEM);
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device,
                                                    unsigned int *utilization,
                                                    unsigned int *samplingPeriodUs) {
    DEV_ENTER(nvmlDeviceGetEncoderUtilization)
    if (!utilization || !samplingPeriodUs) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *utilization = fk_u32(d, F_UTIL_ENC);
    *samplingPeriodUs = 167000;
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device,
                                                    unsigned int *utilization,
                                                    unsigned int *samplingPeriodUs) {
    DEV_ENTER(nvmlDeviceGetDecoderUtilization)
    if (!utilization || !samplingPeriodUs) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *utilization = fk_u32(d, F_UTIL_DEC);
    *samplingPeriodUs = 167000;
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device,
                                             nvmlTemperatureSensors_t sensorType,
                                             unsigned int *temp) {
    DEV_ENTER(nvmlDeviceGetTemperature)
    if (!temp || sensorType != NVML_TEMPERATURE_GPU) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *temp = fk_u32(d, F_TEMP);
    DEV_RETURN(NVML_SUCCESS);
}

#if FK_HAS_TEMPERATURE_V /* before 565.57.01: nvmlDeviceGetTemperature only */
EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device,
                                              nvmlTemperature_t *temperature) {
    DEV_ENTER(nvmlDeviceGetTemperatureV)
    if (!temperature || temperature->sensorType != NVML_TEMPERATURE_GPU)
        DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (temperature->version != 0x100000C) DEV_RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    temperature->temperature = (int)fk_eval(&d->f[F_TEMP], fk_now() - S->t0);
    DEV_RETURN(NVML_SUCCESS);
}
#endif

#define FK_U32_GETTER(name, field)                                         \
    EXPORT nvmlReturn_t name(nvmlDevice_t device, unsigned int *out) {     \
        DEV_ENTER(name)                                                    \
        if (!out) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);                 \
        *out = fk_u32(d, field);                                           \
        DEV_RETURN(NVML_SUCCESS);                                          \
    }

FK_U32_GETTER(nvmlDeviceGetPowerUsage, F_POWER)
FK_U32_GETTER(nvmlDeviceGetEnforcedPowerLimit, F_POWER_LIMIT)

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device,
                                                        unsigned long long *energy) {
    DEV_ENTER(nvmlDeviceGetTotalEnergyConsumption)
    if (!energy) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *energy = fk_u64(d, F_ENERGY);
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type,
                                           unsigned int *clock) {
    DEV_ENTER(nvmlDeviceGetClockInfo)
    static const int fields[] = {F_CLK_GRAPHICS, F_CLK_SM, F_CLK_MEM, F_CLK_VIDEO};
    if (!clock || (int)type < 0 || (int)type > 3) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *clock = fk_u32(d, fields[type]);
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device,
                                                nvmlPcieUtilCounter_t counter,
                                                unsigned int *value) {
    DEV_ENTER(nvmlDeviceGetPcieThroughput)
    if (!value || (int)counter < 0 || (int)counter > 1) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *value = fk_u32(d, counter == NVML_PCIE_UTIL_TX_BYTES ? F_PCIE_TX : F_PCIE_RX);
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device,
                                                nvmlMemoryErrorType_t errorType,
                                                nvmlEccCounterType_t counterType,
                                                unsigned long long *eccCounts) {
    DEV_ENTER(nvmlDeviceGetTotalEccErrors)
    if (!eccCounts || (int)errorType < 0 || (int)errorType > 1 || (int)counterType < 0 ||
        (int)counterType > 1)
        DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *eccCounts = fk_u64(d, errorType == NVML_MEMORY_ERROR_TYPE_CORRECTED ? F_ECC_CORR : F_ECC_UNCORR);
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                         unsigned int *pendingMode) {
    DEV_ENTER(nvmlDeviceGetMigMode)
    if (!currentMode || !pendingMode) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *currentMode = fk_u32(d, F_MIG);
    *pendingMode = fk_u32(d, F_MIG_PENDING);
    DEV_RETURN(NVML_SUCCESS);
}

/* Drivers before the rename to "clocks event" reasons (535.43.02) have only the "throttle"
 * name; newer ones keep it, deprecated. */
#if FK_HAS_CLOCKS_EVENT
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                           unsigned long long *clocksEventReasons) {
    DEV_ENTER(nvmlDeviceGetCurrentClocksEventReasons)
    if (!clocksEventReasons) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *clocksEventReasons = fk_u64(d, F_REASONS);
    DEV_RETURN(NVML_SUCCESS);
}
#endif

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(
    nvmlDevice_t device, unsigned long long *clocksThrottleReasons) {
    DEV_ENTER(nvmlDeviceGetCurrentClocksThrottleReasons)
    if (!clocksThrottleReasons) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *clocksThrottleReasons = fk_u64(d, F_REASONS);
    DEV_RETURN(NVML_SUCCESS);
}

/* One source of process entries: a GPU's list, or a MIG device's (with its ids). */
typedef struct {
    const fk_proc *procs;
    int n;
    unsigned int gi, ci;
} fk_plist;

/* The entries of the process list `kind` of a GPU outside MIG mode (ids FK_NO_INSTANCE), of a
 * MIG device, or of a GPU in MIG mode (its MIG devices' lists, in index order: NVML's aggregate
 * view; the GPU's own list is not used then): the sources and their total count. */
static unsigned int fk_process_sources(const fk_dev *d, const fk_mig *m, int kind,
                                       fk_plist lists[FK_MAX_MIG], int *nl) {
    *nl = 0;
    if (m) {
        lists[(*nl)++] = (fk_plist){m->procs[kind], m->nproc[kind], m->gi, m->ci};
    } else if (fk_mig_on(d)) {
        for (int i = 0; i < FK_MAX_MIG; i++)
            if (d->mig[i].present)
                lists[(*nl)++] = (fk_plist){d->mig[i].procs[kind], d->mig[i].nproc[kind],
                                            d->mig[i].gi, d->mig[i].ci};
    } else {
        lists[(*nl)++] =
            (fk_plist){d->procs[kind], d->nproc[kind], FK_NO_INSTANCE, FK_NO_INSTANCE};
    }
    unsigned int n = 0;
    for (int l = 0; l < *nl; l++) n += (unsigned int)lists[l].n;
    return n;
}

/* Writes the n entries of `lists` into `out`, `size` bytes apart, in the layout every
 * nvml.h gives them: pid at 0, usedGpuMemory at 8; from 24 bytes gpuInstanceId at 16 and
 * computeInstanceId at 20; with 32 bytes usedGpuCcProtectedMemory at 24 (the _v3 entries of
 * 535.43.02-535.86.x and nvmlProcessDetail_v1_t). */
static void fk_write_entries(const fk_plist *lists, int nl, unsigned char *out, size_t size) {
    double rel = fk_now() - S->t0;
    for (int l = 0; l < nl; l++)
        for (int i = 0; i < lists[l].n; i++, out += size) {
            const fk_proc *p = &lists[l].procs[i];
            double used = p->used.base + p->used.slope * rel;
            unsigned long long mem =
                p->na ? FK_NOT_AVAILABLE : (used > 0 ? (unsigned long long)(used + 0.5) : 0);
            memset(out, 0, size);
            memcpy(out, &p->pid, 4);
            memcpy(out + 8, &mem, 8);
            if (size >= 24) {
                memcpy(out + 16, &lists[l].gi, 4);
                memcpy(out + 20, &lists[l].ci, 4);
            }
            if (size >= 32) memcpy(out + 24, &p->cc, 8);
        }
}

/* NVML's two-call protocol over the process list `kind`, entries `size` bytes each. */
static nvmlReturn_t fk_running_processes(const fk_dev *d, const fk_mig *m, int kind,
                                         unsigned int *infoCount, void *infos, size_t size) {
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    fk_plist lists[FK_MAX_MIG];
    int nl;
    unsigned int cap = *infoCount, n = fk_process_sources(d, m, kind, lists, &nl);
    *infoCount = n;
    if (n == 0) return NVML_SUCCESS;
    if (!infos || cap < n) return NVML_ERROR_INSUFFICIENT_SIZE;
    fk_write_entries(lists, nl, infos, size);
    return NVML_SUCCESS;
}

/* The three lists in each version the branch has: unversioned (16-byte v1 entries; every
 * driver keeps them), _v2 (24 bytes, from the drivers that brought MIG) and _v3 (510.39.01 on;
 * not in 535.98), whose entry is nvmlProcessInfo_t: 24 bytes, 32 in 535.43.02-535.86.x. */
#define FK_PROCESS_LIST(name, kind, entry)                                                  \
    EXPORT nvmlReturn_t name(nvmlDevice_t device, unsigned int *infoCount, entry *infos) {  \
        DEV_ENTER_ANY(name)                                                                 \
        DEV_RETURN(fk_running_processes(d, m, kind, infoCount, infos, sizeof(entry)));      \
    }

FK_PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses, 0, nvmlProcessInfo_v1_t)
FK_PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses, 1, nvmlProcessInfo_v1_t)
FK_PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses, 2, nvmlProcessInfo_v1_t)
FK_PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v2, 0, FK_V2_ENTRY)
FK_PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, 1, FK_V2_ENTRY)
FK_PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, 2, FK_V2_ENTRY)
#if FK_HAS_V3_LISTS
FK_PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v3, 0, nvmlProcessInfo_t)
FK_PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, 1, nvmlProcessInfo_t)
FK_PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, 2, nvmlProcessInfo_t)
#endif

#if FK_HAS_DETAIL_LIST
/* 535.104.05 on: one versioned call for the three lists (mode 0..2), 32-byte entries that
 * carry usedGpuCcProtectedMemory. */
EXPORT nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device,
                                                          nvmlProcessDetailList_t *plist) {
    DEV_ENTER_ANY(nvmlDeviceGetRunningProcessDetailList)
    if (!plist || plist->version != nvmlProcessDetailList_v1 || plist->mode > 2)
        DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    DEV_RETURN(fk_running_processes(d, m, (int)plist->mode, &plist->numProcArrayEntries,
                                    plist->procArray, sizeof(nvmlProcessDetail_v1_t)));
}
#endif

#if FK_HAS_CONF_COMPUTE
/* 535.43.02 on; the fake's GPUs are not confidential-computing ones (as most GPUs). */
EXPORT nvmlReturn_t nvmlDeviceGetConfComputeMemSizeInfo(nvmlDevice_t device,
                                                        nvmlConfComputeMemSizeInfo_t *memInfo) {
    DEV_ENTER(nvmlDeviceGetConfComputeMemSizeInfo)
    (void)d;
    if (!memInfo) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    DEV_RETURN(NVML_ERROR_NOT_SUPPORTED);
}
#endif

EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                    nvmlProcessUtilizationSample_t *utilization,
                                                    unsigned int *processSamplesCount,
                                                    unsigned long long lastSeenTimeStamp) {
    DEV_ENTER(nvmlDeviceGetProcessUtilization)
    if (fk_mig_on(d)) DEV_RETURN(NVML_ERROR_NOT_SUPPORTED); /* no per-process samples in MIG mode */
    if (!processSamplesCount) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long period = fk_u64(d, F_PUTIL_PERIOD) * 1000ULL;
    if (period == 0) period = 1;
    /* Sample times are t0 + whole periods, so a test decides when a new sample appears. */
    double rel = fk_now() - S->t0;
    unsigned long long t0_us = (unsigned long long)(S->t0 * 1e6);
    unsigned long long ts = t0_us + (rel > 0 ? (unsigned long long)(rel * 1e6) / period * period : 0);
    ts += (unsigned long long)(long long)(fk_eval(&d->f[F_PUTIL_OFFSET], rel) * 1000.0); /* skew */
    unsigned int n = (unsigned int)d->nputil, cap = *processSamplesCount;
    /* NVML: no samples newer than the caller's timestamp (idle GPU, or asked twice within one
     * sample period) is NOT_FOUND, also for the size probe. */
    if (n == 0 || ts <= lastSeenTimeStamp) DEV_RETURN(NVML_ERROR_NOT_FOUND);
    *processSamplesCount = n;
    if (!utilization || cap < n) DEV_RETURN(NVML_ERROR_INSUFFICIENT_SIZE);
    for (unsigned int i = 0; i < n; i++) {
        const fk_putil *u = &d->putil[i];
        utilization[i].pid = u->pid;
        utilization[i].timeStamp = ts;
        utilization[i].smUtil = u->sm;
        utilization[i].memUtil = u->mem;
        utilization[i].encUtil = u->enc;
        utilization[i].decUtil = u->dec;
    }
    DEV_RETURN(NVML_SUCCESS);
}

/* ----------------------------------- NVML: MIG ----------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    DEV_ENTER_ANY(nvmlDeviceGetMaxMigDeviceCount)
    if (m || !count) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *count = fk_mig_on(d) ? FK_MAX_MIG : 0;
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *migDevice) {
    DEV_ENTER_ANY(nvmlDeviceGetMigDeviceHandleByIndex)
    if (m || !migDevice || !fk_mig_on(d) || index >= FK_MAX_MIG)
        DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (!d->mig[index].present) DEV_RETURN(NVML_ERROR_NOT_FOUND);
    *migDevice = &fk_mig_handles[idx_][index];
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    DEV_ENTER_ANY(nvmlDeviceIsMigDeviceHandle)
    (void)d;
    if (!isMigDevice) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *isMigDevice = m != NULL;
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                                 nvmlDevice_t *device) {
    DEV_ENTER_OF(nvmlDeviceGetDeviceHandleFromMigDeviceHandle, migDevice)
    (void)d;
    if (!m || !device) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *device = &fk_handles[idx_];
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    DEV_ENTER_ANY(nvmlDeviceGetGpuInstanceId)
    (void)d;
    if (!m || !id) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *id = m->gi;
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    DEV_ENTER_ANY(nvmlDeviceGetComputeInstanceId)
    (void)d;
    if (!m || !id) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *id = m->ci;
    DEV_RETURN(NVML_SUCCESS);
}

/* --------------------------------- NVML: events --------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                     unsigned long long *eventTypes) {
    DEV_ENTER(nvmlDeviceGetSupportedEventTypes)
    if (!eventTypes) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *eventTypes = fk_u64(d, F_SUPPORTED_EVENTS);
    DEV_RETURN(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    nvmlReturn_t rc = fk_enter(SYM_nvmlEventSetCreate, -1, 1);
    if (rc != NVML_SUCCESS) return rc;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    rc = NVML_ERROR_MEMORY;
    pthread_mutex_lock(&fk_mu);
    for (int i = 0; i < FK_MAX_SETS; i++)
        if (!fk_sets[i].in_use) {
            memset(&fk_sets[i], 0, sizeof fk_sets[i]);
            fk_sets[i].in_use = 1;
            *set = &fk_sets[i];
            rc = NVML_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&fk_mu);
    return rc;
}

static int fk_set_ok(nvmlEventSet_t set) {
    return set >= fk_sets && set < fk_sets + FK_MAX_SETS && set->in_use;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                             nvmlEventSet_t set) {
    DEV_ENTER(nvmlDeviceRegisterEvents)
    if (!fk_set_ok(set)) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (eventTypes & ~fk_u64(d, F_SUPPORTED_EVENTS)) DEV_RETURN(NVML_ERROR_NOT_SUPPORTED);
    set->types[idx_] |= eventTypes;
    DEV_RETURN(NVML_SUCCESS);
}

/* Takes one pending Xid event for `set`, if any. Caller holds fk_mu. */
static int fk_take_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    double rel = fk_now() - S->t0;
    for (int i = 0; i < S->ndev; i++) {
        if (!(set->types[i] & nvmlEventTypeXidCriticalError)) continue;
        const fk_dev *d = &S->dev[i];
        int k = fk_xid_delivered[i];
        if (k < d->nxid && d->xid[k].t <= rel) {
            fk_xid_delivered[i]++;
            data->device = &fk_handles[i];
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = d->xid[k].code;
            data->gpuInstanceId = 0xFFFFFFFFU;
            data->computeInstanceId = 0xFFFFFFFFU;
            return 1;
        }
    }
    return 0;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                        unsigned int timeoutms) {
    nvmlReturn_t rc = fk_enter(SYM_nvmlEventSetWait_v2, -1, 1);
    if (rc != NVML_SUCCESS) return rc;
    if (!data) return NVML_ERROR_INVALID_ARGUMENT;
    for (int attempt = 0; attempt < 2; attempt++) {
        pthread_mutex_lock(&fk_mu);
        if (!fk_set_ok(set)) {
            pthread_mutex_unlock(&fk_mu);
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        int got = fk_take_event(set, data);
        pthread_mutex_unlock(&fk_mu);
        if (got) return NVML_SUCCESS;
        if (timeoutms == 0) break;
        if (attempt == 0) fk_sleep_ms((long)timeoutms);
    }
    return NVML_ERROR_TIMEOUT;
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    nvmlReturn_t rc = fk_enter(SYM_nvmlEventSetFree, -1, 1);
    if (rc != NVML_SUCCESS) return rc;
    pthread_mutex_lock(&fk_mu);
    rc = fk_set_ok(set) ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) set->in_use = 0;
    pthread_mutex_unlock(&fk_mu);
    return rc;
}

/* ------------------------------- test-only exports ------------------------------- */

EXPORT unsigned long long fakenvml_call_count_dev(const char *symbol, int gpu) {
    int sym = fk_sym_by_name(symbol);
    if (sym == -2 || gpu < -1 || gpu >= FK_MAX_GPUS) return 0;
    int slot = gpu < 0 ? FK_MAX_GPUS : gpu;
    unsigned long long n = 0;
    pthread_mutex_lock(&fk_mu);
    for (int s = 0; s < FK_NSYM; s++)
        if (sym < 0 || s == sym) n += fk_total_count[s][slot];
    pthread_mutex_unlock(&fk_mu);
    return n;
}

EXPORT unsigned long long fakenvml_call_count(const char *symbol) {
    unsigned long long n = 0;
    for (int g = -1; g < FK_MAX_GPUS; g++) n += fakenvml_call_count_dev(symbol, g);
    return n;
}

EXPORT void fakenvml_reset_counts(void) {
    pthread_mutex_lock(&fk_mu);
    memset(fk_total_count, 0, sizeof fk_total_count);
    pthread_mutex_unlock(&fk_mu);
}

EXPORT int fakenvml_reload(void) {
    pthread_mutex_lock(&fk_mu);
    int rc = fk_maybe_reload(1);
    if (rc == 0 && fk_error[0]) rc = -1;
    pthread_mutex_unlock(&fk_mu);
    return rc;
}

EXPORT const char *fakenvml_last_error(void) { return fk_error; }
