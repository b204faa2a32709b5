module @jit__lambda attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2, "model"=4]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}, {name = "model", size = 4 : i64}]}}
  func.func public @main(%arg0: tensor<64x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data", "model"}, {}]>}, %arg1: tensor<32x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"model"}]>}) -> (tensor<64x64xf32> {jax.result_info = "result", sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {"model"}]>}) {
    %0 = sdy.manual_computation(%arg0, %arg1) in_shardings=[<@mesh, [{"data", "model"}, {}]>, <@mesh, [{}, {"model"}]>] out_shardings=[<@mesh, [{"data"}, {"model"}]>] manual_axes={"data", "model"} (%arg2: tensor<8x32xf32>, %arg3: tensor<32x16xf32>) {
      %c = stablehlo.constant dense<0> : tensor<ui32>
      %c_0 = stablehlo.constant dense<1> : tensor<ui32>
      %c_1 = stablehlo.constant dense<2> : tensor<ui32>
      %c_2 = stablehlo.constant dense<3> : tensor<ui32>
      %c_3 = stablehlo.constant dense<4> : tensor<ui32>
      %c_4 = stablehlo.constant dense<8> : tensor<ui32>
      %cst = stablehlo.constant dense<0.000000e+00> : tensor<32x16xf32>
      %c_5 = stablehlo.constant dense<[0, 1, 2, 3, 0, 1, 2, 3]> : tensor<8xui32>
      %1 = stablehlo.partition_id : tensor<ui32>
      %2 = stablehlo.dynamic_slice %c_5, %1, sizes = [1] : (tensor<8xui32>, tensor<ui32>) -> tensor<1xui32>
      %3 = stablehlo.reshape %2 : (tensor<1xui32>) -> tensor<ui32>
      %4 = "stablehlo.collective_permute"(%arg2) <{channel_handle = #stablehlo.channel_handle<handle = 2, type = 1>, source_target_pairs = dense<[[0, 3], [1, 0], [2, 1], [3, 2], [4, 7], [5, 4], [6, 5], [7, 6]]> : tensor<8x2xi64>}> : (tensor<8x32xf32>) -> tensor<8x32xf32>
      %5 = "stablehlo.collective_permute"(%arg2) <{channel_handle = #stablehlo.channel_handle<handle = 3, type = 1>, source_target_pairs = dense<[[0, 1], [1, 2], [2, 3], [3, 0], [4, 5], [5, 6], [6, 7], [7, 4]]> : tensor<8x2xi64>}> : (tensor<8x32xf32>) -> tensor<8x32xf32>
      %6 = stablehlo.dot_general %arg2, %arg3, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
      %7 = stablehlo.multiply %3, %c_4 : tensor<ui32>
      %8 = stablehlo.dynamic_update_slice %cst, %6, %7, %c : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<ui32>, tensor<ui32>) -> tensor<32x16xf32>
      %9:2 = stablehlo.optimization_barrier %4, %6 : tensor<8x32xf32>, tensor<8x16xf32>
      %10 = "stablehlo.collective_permute"(%9#0) <{channel_handle = #stablehlo.channel_handle<handle = 4, type = 1>, source_target_pairs = dense<[[0, 3], [1, 0], [2, 1], [3, 2], [4, 7], [5, 4], [6, 5], [7, 6]]> : tensor<8x2xi64>}> : (tensor<8x32xf32>) -> tensor<8x32xf32>
      %11 = stablehlo.add %3, %c_0 : tensor<ui32>
      %12 = stablehlo.remainder %11, %c_3 : tensor<ui32>
      %13:2 = stablehlo.optimization_barrier %4, %arg3 : tensor<8x32xf32>, tensor<32x16xf32>
      %14 = stablehlo.dot_general %13#0, %13#1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
      %15 = stablehlo.multiply %12, %c_4 : tensor<ui32>
      %16 = stablehlo.dynamic_update_slice %8, %14, %15, %c : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<ui32>, tensor<ui32>) -> tensor<32x16xf32>
      %17 = stablehlo.add %3, %c_2 : tensor<ui32>
      %18 = stablehlo.remainder %17, %c_3 : tensor<ui32>
      %19:2 = stablehlo.optimization_barrier %5, %arg3 : tensor<8x32xf32>, tensor<32x16xf32>
      %20 = stablehlo.dot_general %19#0, %19#1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
      %21 = stablehlo.multiply %18, %c_4 : tensor<ui32>
      %22 = stablehlo.dynamic_update_slice %16, %20, %21, %c : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<ui32>, tensor<ui32>) -> tensor<32x16xf32>
      %23 = stablehlo.add %3, %c_1 : tensor<ui32>
      %24 = stablehlo.remainder %23, %c_3 : tensor<ui32>
      %25:2 = stablehlo.optimization_barrier %10, %arg3 : tensor<8x32xf32>, tensor<32x16xf32>
      %26 = stablehlo.dot_general %25#0, %25#1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
      %27 = stablehlo.multiply %24, %c_4 : tensor<ui32>
      %28 = stablehlo.dynamic_update_slice %22, %26, %27, %c : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<ui32>, tensor<ui32>) -> tensor<32x16xf32>
      sdy.return %28 : tensor<32x16xf32>
    } : (tensor<64x32xf32>, tensor<32x64xf32>) -> tensor<64x64xf32>
    return %0 : tensor<64x64xf32>
  }
}
