module @jit__lambda attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2, "model"=4]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}, {name = "model", size = 4 : i64}]}}
  func.func public @main(%arg0: tensor<64x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data", "model"}, {}]>}, %arg1: tensor<32x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"model"}]>}) -> (tensor<64x64xf32> {jax.result_info = "result", sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {"model"}]>}) {
    %0 = sdy.manual_computation(%arg0, %arg1) in_shardings=[<@mesh, [{"data", "model"}, {}]>, <@mesh, [{}, {"model"}]>] out_shardings=[<@mesh, [{"data"}, {"model"}]>] manual_axes={"data", "model"} (%arg2: tensor<8x32xf32>, %arg3: tensor<32x16xf32>) {
      %c = stablehlo.constant dense<[0, 1, 2, 3, 0, 1, 2, 3]> : tensor<8xi32>
      %1 = stablehlo.partition_id : tensor<ui32>
      %2 = stablehlo.convert %1 : (tensor<ui32>) -> tensor<i32>
      %3 = stablehlo.dynamic_slice %c, %2, sizes = [1] : (tensor<8xi32>, tensor<i32>) -> tensor<1xi32>
      %4 = stablehlo.reshape %3 : (tensor<1xi32>) -> tensor<i32>
      %cst = stablehlo.constant dense<0.000000e+00> : tensor<32x16xf32>
      %5 = "stablehlo.collective_permute"(%arg2) <{channel_handle = #stablehlo.channel_handle<handle = 2, type = 1>, source_target_pairs = dense<[[0, 3], [1, 0], [2, 1], [3, 2], [4, 7], [5, 4], [6, 5], [7, 6]]> : tensor<8x2xi64>}> {mhlo.frontend_attributes = {_scheduling_group_id = "0"}} : (tensor<8x32xf32>) -> tensor<8x32xf32>
      %6 = "stablehlo.collective_permute"(%arg2) <{channel_handle = #stablehlo.channel_handle<handle = 3, type = 1>, source_target_pairs = dense<[[0, 1], [1, 2], [2, 3], [3, 0], [4, 5], [5, 6], [6, 7], [7, 4]]> : tensor<8x2xi64>}> : (tensor<8x32xf32>) -> tensor<8x32xf32>
      %7 = func.call @cmatmul_dot_0(%arg2, %arg3) {mhlo.frontend_attributes = {_scheduling_group_id = "0", _xla_stream_annotation = "1", inlineable = "false"}} : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
      %c_0 = stablehlo.constant dense<8> : tensor<i32>
      %8 = stablehlo.multiply %4, %c_0 : tensor<i32>
      %c_1 = stablehlo.constant dense<0> : tensor<i32>
      %9 = stablehlo.dynamic_update_slice %cst, %7, %8, %c_1 : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<i32>, tensor<i32>) -> tensor<32x16xf32>
      %10 = "stablehlo.collective_permute"(%5) <{channel_handle = #stablehlo.channel_handle<handle = 4, type = 1>, source_target_pairs = dense<[[0, 3], [1, 0], [2, 1], [3, 2], [4, 7], [5, 4], [6, 5], [7, 6]]> : tensor<8x2xi64>}> {mhlo.frontend_attributes = {_scheduling_group_id = "1"}} : (tensor<8x32xf32>) -> tensor<8x32xf32>
      %c_2 = stablehlo.constant dense<1> : tensor<i32>
      %11 = stablehlo.add %4, %c_2 : tensor<i32>
      %c_3 = stablehlo.constant dense<4> : tensor<i32>
      %12 = stablehlo.remainder %11, %c_3 : tensor<i32>
      %13 = func.call @cmatmul_dot_0(%5, %arg3) {mhlo.frontend_attributes = {_scheduling_group_id = "1", _xla_stream_annotation = "3", inlineable = "false"}} : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
      %14 = stablehlo.multiply %12, %c_0 : tensor<i32>
      %15 = stablehlo.dynamic_update_slice %9, %13, %14, %c_1 : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<i32>, tensor<i32>) -> tensor<32x16xf32>
      %c_4 = stablehlo.constant dense<3> : tensor<i32>
      %16 = stablehlo.add %4, %c_4 : tensor<i32>
      %17 = stablehlo.remainder %16, %c_3 : tensor<i32>
      %18 = func.call @cmatmul_dot_0(%6, %arg3) {mhlo.frontend_attributes = {_xla_stream_annotation = "4", inlineable = "false"}} : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
      %19 = stablehlo.multiply %17, %c_0 : tensor<i32>
      %20 = stablehlo.dynamic_update_slice %15, %18, %19, %c_1 : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<i32>, tensor<i32>) -> tensor<32x16xf32>
      %c_5 = stablehlo.constant dense<2> : tensor<i32>
      %21 = stablehlo.add %4, %c_5 : tensor<i32>
      %22 = stablehlo.remainder %21, %c_3 : tensor<i32>
      %23 = func.call @cmatmul_dot_0(%10, %arg3) {mhlo.frontend_attributes = {_xla_stream_annotation = "1", inlineable = "false"}} : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
      %24 = stablehlo.multiply %22, %c_0 : tensor<i32>
      %25 = stablehlo.dynamic_update_slice %20, %23, %24, %c_1 : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<i32>, tensor<i32>) -> tensor<32x16xf32>
      sdy.return %25 : tensor<32x16xf32>
    } : (tensor<64x32xf32>, tensor<32x64xf32>) -> tensor<64x64xf32>
    return %0 : tensor<64x64xf32>
  }
  func.func private @cmatmul_dot_0(%arg0: tensor<8x32xf32>, %arg1: tensor<32x16xf32>) -> tensor<8x16xf32> {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
    return %0 : tensor<8x16xf32>
  }
}
